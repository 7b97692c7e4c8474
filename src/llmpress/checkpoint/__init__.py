"""The one save path (``save_checkpoint``) and a minimal reader of what it writes."""

from llmpress.checkpoint.save import route_save_pretrained, save_checkpoint

__all__ = ["save_checkpoint", "route_save_pretrained"]
