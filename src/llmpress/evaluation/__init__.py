from llmpress.evaluation.divergence import kl_divergence
from llmpress.evaluation.perplexity import PerplexityResult, evaluation_windows, perplexity

__all__ = ["PerplexityResult", "evaluation_windows", "kl_divergence", "perplexity"]
