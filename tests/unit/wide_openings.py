"""How the extra training wordings (``contracts.EXTRA_PHRASINGS``) open their clauses, which no
other wording does: the corpus and trainer tests both look for them."""

EXTRA_OPENINGS = ("Duration:", "Convenience termination:", "Liability limit of the", "Applicable law:",
                  "Payment terms:", "Confidentiality obligations:", "Assignment by the")  # fmt: skip
