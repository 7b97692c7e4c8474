from llmpress.evaluation.perplexity import PerplexityResult, evaluation_windows, perplexity

__all__ = ["PerplexityResult", "evaluation_windows", "perplexity"]
