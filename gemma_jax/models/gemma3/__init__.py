"""Gemma 3: its decoder layer (`layer`), SigLIP vision tower (`vision`) and image
preprocessing (`images`)."""
