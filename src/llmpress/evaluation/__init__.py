from llmpress.evaluation.perplexity import PerplexityResult, evaluation_windows, kl_divergence, perplexity

__all__ = ["PerplexityResult", "evaluation_windows", "kl_divergence", "perplexity"]
