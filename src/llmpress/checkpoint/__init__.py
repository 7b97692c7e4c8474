"""The one save path (``save_checkpoint``), ``save_pretrained`` routed to it, and a minimal reader of what it writes."""

from llmpress.checkpoint.output import check_output, claimed_output
from llmpress.checkpoint.save import save_checkpoint
from llmpress.checkpoint.save_pretrained import route_save_pretrained, upload_to_hub

__all__ = ["check_output", "claimed_output", "route_save_pretrained", "save_checkpoint", "upload_to_hub"]
