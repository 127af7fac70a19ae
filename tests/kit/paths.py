"""Where the tests find the repository and the project's shared data."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data" / "medical_flashcards"
