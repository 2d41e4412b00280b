"""User attention variants: score_mod / mask_mod functions and their derivatives."""
