"""Extraction targets of the demo corpus: a contract and a JSON Schema of some of its facts.

An ``extract`` job (``worker/extract_job.py``) reads a value valid against a schema from a
document. The corpus asks for the facts the contract's clauses state, one field per clause kind
(the kinds of ``worker.training.questions``), each an ``enum`` of every value the corpus writes
(``null`` where the contract may have no such right or term), all required: so the canvas
(``worker/structured/canvas.py``) lays every field out as one choice slot, committed as a unit
like a decision's answer, and a field is right or wrong with nothing in between. Plain Python.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from worker.training.contracts import (
    CAP_AMOUNTS,
    LAWS,
    NOTICE_DAYS,
    PAYMENT_DAYS,
    RENEWAL_YEARS,
    SURVIVAL_YEARS,
    TERM_YEARS,
    ContractFacts,
)

ASSIGNEES = {"free": "anyone", "affiliates": "affiliates", "consent": "no one"}


@dataclass(frozen=True)
class ExtractField:
    name: str
    values: tuple[Any, ...]  # the enum: every value the corpus writes for it
    description: str


FIELDS: dict[str, ExtractField] = {  # clause kind -> its field
    "liability": ExtractField("liability_cap", (*CAP_AMOUNTS, None), "EUR; null when unlimited"),
    "termination": ExtractField("notice_days", (*NOTICE_DAYS, None),
                                "to terminate for convenience; null when not allowed"),
    "renewal": ExtractField("renewal_years", (*RENEWAL_YEARS, None), "null when it does not renew"),
    "term": ExtractField("term_years", TERM_YEARS, "the initial term"),
    "confidentiality": ExtractField("confidentiality_years", (*SURVIVAL_YEARS, None),
                                    "after termination; null when none"),
    "law": ExtractField("governing_law", LAWS, "the country"),
    "payment": ExtractField("payment_days", PAYMENT_DAYS, "to pay an invoice"),
    "assignment": ExtractField("assign_without_consent", tuple(ASSIGNEES.values()),
                               "to whom the first party may assign freely"),
}  # fmt: skip
CLAUSE_OF = {"renewal": "term"}  # a kind whose clause has another name (the rest: the kind's own)


def field_value(kind: str, f: ContractFacts) -> Any:
    """The true value of ``kind``'s field for ``f``."""
    return {
        "liability": f.cap, "termination": f.notice_days, "renewal": f.renewal_years, "term": f.term_years,
        "confidentiality": f.survival_years, "law": f.law, "payment": f.payment_days,
        "assignment": ASSIGNEES[f.assignment],
    }[kind]  # fmt: skip


def extraction_schema(kinds: tuple[str, ...]) -> dict[str, Any]:
    """The schema of an extraction case asking ``kinds``' fields, in that order."""
    properties = {
        FIELDS[k].name: {"enum": list(FIELDS[k].values), "description": FIELDS[k].description} for k in kinds
    }
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


def draw_kinds(rng: random.Random) -> tuple[str, ...]:
    """Two or three field kinds, in a random order."""
    return tuple(rng.sample(sorted(FIELDS), rng.choice((2, 3))))


def clauses_of(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The clauses a contract must state so that ``kinds``' fields can be read from it."""
    return tuple(CLAUSE_OF.get(k, k) for k in kinds)


@dataclass(frozen=True)
class ExtractionCase:
    context: str
    kinds: tuple[str, ...]
    answer: dict[str, Any]  # field name -> true value, in schema order

    @property
    def schema(self) -> dict[str, Any]:
        return extraction_schema(self.kinds)

    def job_input(self) -> dict[str, object]:
        """The body's ``input`` of an ``extract`` job asking this case."""
        return {"context": self.context, "schema": self.schema}
