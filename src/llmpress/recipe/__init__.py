from llmpress.recipe.recipe import APPLIED_RECIPE_ATTR, Recipe, RecipeStage

__all__ = ["APPLIED_RECIPE_ATTR", "Recipe", "RecipeStage"]
