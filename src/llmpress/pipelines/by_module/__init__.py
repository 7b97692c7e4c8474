"""The module-by-module route through a block ("true sequential"): ``plan.py`` learns the
block's data flow from one probed forward (``probe.py``), ``sequential.py`` runs it stage by
stage with every Linear multiplying once, held to ``pipelines/reference.py``'s results."""
