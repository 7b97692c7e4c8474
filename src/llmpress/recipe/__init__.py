from llmpress.recipe.recipe import Recipe, RecipeStage

__all__ = ["Recipe", "RecipeStage"]
