"""The only code that touches transformers beyond its public model API: its quantizer registry (``LlmpressConfig`` in ``from_pretrained``) and the Trainer integration."""
