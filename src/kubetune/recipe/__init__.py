"""The recipe: one typed YAML document that drives training, the cluster job and serving."""

from kubetune.recipe.loader import LoadedRecipe, builtin_recipes, load_recipe, recipe_to_yaml
from kubetune.recipe.schema import Recipe

__all__ = ["LoadedRecipe", "Recipe", "builtin_recipes", "load_recipe", "recipe_to_yaml"]
