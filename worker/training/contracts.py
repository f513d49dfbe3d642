"""Synthetic contracts for the trained demo: the facts of one contract and its clauses in words.

A contract is a ``ContractFacts`` (who the parties are, the term and renewal, termination for
convenience and its notice, the liability cap, governing law, payment days, confidentiality,
assignment) drawn from a seeded ``random.Random``; ``render_contract`` writes it as numbered
clauses, each clause type phrased in one of ``PHRASINGS`` ways. Phrasing ``HELD_OUT_PHRASING`` of
every clause type is never used for training, so an evaluation set written only with it shows
whether the model reads the clause or matches a template.

Plain Python (no torch): the corpus is product code (``cloverq model train-demo`` trains on it,
``cloverq model eval`` evaluates on it) and its tests run in milliseconds.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import astuple, dataclass

PHRASINGS = 4  # ways each clause type is written in the evaluation sets (and the default training split)
HELD_OUT_PHRASING = 3  # never in training: the "held-out phrasings" evaluation set
TRAIN_PHRASINGS: tuple[int, ...] = tuple(p for p in range(PHRASINGS) if p != HELD_OUT_PHRASING)
# Three more ways, in the training split ``train_wide`` only (``train-demo --wide-phrasings``):
# more wordings of one fact to read it from, so that a model keys on the fact rather than on the
# template; written without the held-out phrasing's words, which stay unseen.
EXTRA_PHRASINGS: tuple[int, ...] = (4, 5, 6)

ROLES: tuple[tuple[str, str], ...] = (
    ("Supplier", "Buyer"),
    ("Licensor", "Licensee"),
    ("Provider", "Customer"),
    ("Seller", "Purchaser"),
)
NAMES: tuple[str, ...] = (
    "Acme Ltd",
    "Birch plc",
    "Cobalt GmbH",
    "Delta SA",
    "Ember Inc",
    "Fjord AS",
    "Garnet BV",
    "Harbor LLC",
)
TERM_YEARS: tuple[int, ...] = (1, 2, 3, 5)
RENEWAL_YEARS: tuple[int, ...] = (1, 2)
NOTICE_DAYS: tuple[int, ...] = (15, 30, 45, 60, 90)
CAP_AMOUNTS: tuple[int, ...] = (250_000, 500_000, 1_000_000, 2_000_000, 5_000_000)
LAWS: tuple[str, ...] = ("France", "Spain", "Norway", "Italy", "Germany", "Ireland")
PAYMENT_DAYS: tuple[int, ...] = (14, 30, 45, 60)
SURVIVAL_YEARS: tuple[int, ...] = (1, 2, 3, 5)
ASSIGNMENT: tuple[str, ...] = ("consent", "free", "affiliates")  # how the Supplier may assign


@dataclass(frozen=True)
class ContractFacts:
    """Everything a question about the contract can be answered from (``None``: no such clause)."""

    roles: tuple[str, str]  # (first party's role, second party's role), e.g. Supplier / Buyer
    names: tuple[str, str]
    term_years: int
    renewal_years: int | None  # None: no automatic renewal
    notice_days: int | None  # the second party may terminate for convenience on this notice; None: no
    cap: int | None  # the first party's liability cap; None: unlimited
    law: str
    payment_days: int
    survival_years: int | None  # None: no confidentiality clause
    assignment: str  # one of ASSIGNMENT

    def digest(self) -> int:
        """A stable hash of the facts (``hash()`` is salted per process): splits the fact space."""
        return int.from_bytes(hashlib.sha256(repr(astuple(self)).encode()).digest()[:8], "big")


def draw_facts(rng: random.Random) -> ContractFacts:
    roles = rng.choice(ROLES)
    a, b = rng.sample(NAMES, 2)
    return ContractFacts(
        roles=roles,
        names=(a, b),
        term_years=rng.choice(TERM_YEARS),
        renewal_years=rng.choice(RENEWAL_YEARS) if rng.random() < 0.5 else None,
        notice_days=rng.choice(NOTICE_DAYS) if rng.random() < 0.5 else None,
        cap=rng.choice(CAP_AMOUNTS) if rng.random() < 0.6 else None,
        law=rng.choice(LAWS),
        payment_days=rng.choice(PAYMENT_DAYS),
        survival_years=rng.choice(SURVIVAL_YEARS) if rng.random() < 0.7 else None,
        assignment=rng.choice(ASSIGNMENT),
    )


def money(amount: int) -> str:
    return f"EUR {amount:,}"


def years(n: int) -> str:
    return "one year" if n == 1 else f"{n} years"


# --- the clauses, each in PHRASINGS ways ------------------------------------------------------------
def _parties(f: ContractFacts, p: int) -> str:
    (ra, rb), (na, nb) = f.roles, f.names
    return (
        f"This agreement is made between {na} (the {ra}) and {nb} (the {rb}).",
        f"Parties: {na}, the {ra}, and {nb}, the {rb}.",
        f"{na} acts as the {ra} and {nb} acts as the {rb} under this agreement.",
        f"The {ra} is {na}; the {rb} is {nb}.",
        f"{na} ({ra}) and {nb} ({rb}) enter into this agreement.",
        f"This agreement is concluded between {na} as the {ra} and {nb} as the {rb}.",
        f"The parties to this agreement are {na}, referred to as the {ra}, and {nb}, referred to as "
        f"the {rb}.",
    )[p]


def _term(f: ContractFacts, p: int) -> str:
    t = years(f.term_years)
    if f.renewal_years is None:
        return (
            f"The agreement runs for {t} and then ends.",
            f"Term: {t}, with no automatic renewal.",
            f"This agreement lasts {t} and does not renew by itself.",
            f"The initial term is {t}; it expires without renewal.",
            f"Duration: {t}; renewal: none.",
            f"The agreement remains in force for {t} and is not renewed.",
            f"This agreement has a fixed term of {t} with no renewal.",
        )[p]
    r = years(f.renewal_years)
    return (
        f"The agreement runs for {t} and then renews automatically for periods of {r}.",
        f"Term: {t}, renewing automatically for further terms of {r}.",
        f"This agreement lasts {t} and renews by itself for {r} at a time.",
        f"The initial term is {t}; thereafter it is extended automatically by {r} each time.",
        f"Duration: {t}; renewal: automatic, in periods of {r}.",
        f"The agreement remains in force for {t} and is then renewed automatically, each renewal "
        f"lasting {r}.",
        f"This agreement is in effect for {t}, after which it automatically renews for successive "
        f"periods of {r}.",
    )[p]


def _termination(f: ContractFacts, p: int) -> str:
    rb = f.roles[1]
    if f.notice_days is None:
        return (
            f"The {rb} may not terminate this agreement for convenience.",
            f"Termination for convenience: not permitted for the {rb}.",
            f"The {rb} has no right to end the agreement without cause.",
            f"No termination without cause is available to the {rb}.",
            f"Convenience termination: none for the {rb}.",
            f"The {rb} cannot cancel this agreement for convenience.",
            f"This agreement gives the {rb} no right to terminate it at will.",
        )[p]
    d = f.notice_days
    return (
        f"The {rb} may terminate this agreement for convenience on {d} days notice.",
        f"Termination for convenience: the {rb}, with {d} days written notice.",
        f"The {rb} may end the agreement without cause by giving {d} days notice.",
        f"Upon {d} days prior notice the {rb} can end this agreement without cause.",
        f"Convenience termination: the {rb} may do so with {d} days notice.",
        f"The {rb} is allowed to cancel this agreement for convenience by notifying the other party {d} "
        "days in advance.",
        f"The {rb} has the right to terminate at will, subject to {d} days notice.",
    )[p]


def _liability(f: ContractFacts, p: int) -> str:
    ra = f.roles[0]
    if f.cap is None:
        return (
            f"The liability of the {ra} is not limited.",
            f"Liability: the {ra} has unlimited liability.",
            f"No cap applies to the liability of the {ra}.",
            f"The {ra} shall be liable without any limit.",
            f"Liability limit of the {ra}: none.",
            f"The {ra} bears liability without a cap.",
            f"There is no limit on the liability of the {ra}.",
        )[p]
    m = money(f.cap)
    return (
        f"The liability of the {ra} is limited to {m}.",
        f"Liability: the {ra} is liable up to {m} in total.",
        f"The total liability of the {ra} shall not exceed {m}.",
        f"The {ra} shall be liable for no more than {m}.",
        f"Liability limit of the {ra}: {m}.",
        f"The {ra} bears liability up to a cap of {m}.",
        f"The aggregate liability of the {ra} is capped at {m}.",
    )[p]


def _law(f: ContractFacts, p: int) -> str:
    return (
        f"This agreement is governed by the laws of {f.law}.",
        f"Governing law: {f.law}.",
        f"The laws of {f.law} apply to this agreement.",
        f"This agreement shall be construed under {f.law} law.",
        f"Applicable law: {f.law}.",
        f"The agreement is subject to the laws of {f.law}.",
        f"Any dispute under this agreement is decided under the laws of {f.law}.",
    )[p]


def _payment(f: ContractFacts, p: int) -> str:
    rb, d = f.roles[1], f.payment_days
    return (
        f"The {rb} shall pay each invoice within {d} days.",
        f"Payment: invoices are due {d} days after receipt.",
        f"The {rb} must settle every invoice no later than {d} days after it is issued.",
        f"Each invoice is payable by the {rb} {d} days from its date.",
        f"Payment terms: {d} days.",
        f"The {rb} must pay invoices within {d} days of receipt.",
        f"The {rb} settles each invoice at the latest {d} days after receiving it.",
    )[p]


def _confidentiality(f: ContractFacts, p: int) -> str:
    if f.survival_years is None:
        return (
            "The agreement has no confidentiality obligations.",
            "Confidentiality: none.",
            "Neither party owes any duty of confidentiality.",
            "No confidentiality terms are included in this agreement.",
            "Confidentiality obligations: none.",
            "The parties have no confidentiality duties under this agreement.",
            "This agreement contains no confidentiality clause.",
        )[p]
    s = years(f.survival_years)
    return (
        f"Both parties keep information confidential for {s} after termination.",
        f"Confidentiality: both parties, surviving {s} after termination.",
        f"Each party shall protect confidential information until {s} after the agreement ends.",
        f"Confidential information stays protected for a period of {s} following termination.",
        f"Confidentiality obligations: mutual, for {s} after termination.",
        f"The parties must keep each other's information secret for {s} after the agreement ends.",
        f"Confidentiality duties continue for {s} after termination of this agreement.",
    )[p]


def _assignment(f: ContractFacts, p: int) -> str:
    ra, rb = f.roles
    if f.assignment == "consent":
        return (
            f"The {ra} may not assign this agreement without the consent of the {rb}.",
            f"Assignment: only with the written consent of the {rb}.",
            f"Any assignment by the {ra} requires the prior consent of the {rb}.",
            f"The {ra} needs the approval of the {rb} before transferring this agreement.",
            f"Assignment by the {ra}: only with consent of the {rb}.",
            f"The {ra} cannot transfer this agreement unless the {rb} agrees in writing.",
            f"Without the consent of the {rb}, the {ra} may not assign this agreement.",
        )[p]
    if f.assignment == "free":
        return (
            f"The {ra} may assign this agreement freely.",
            "Assignment: permitted without consent.",
            f"The {ra} may transfer this agreement to anyone without consent.",
            f"No approval is needed for the {ra} to transfer this agreement.",
            f"Assignment by the {ra}: free, no consent required.",
            f"The {ra} can transfer this agreement to any party without consent.",
            f"The {ra} is free to assign this agreement without anyone's consent.",
        )[p]
    return (
        f"The {ra} may assign this agreement to its affiliates only; "
        f"otherwise the consent of the {rb} is required.",
        f"Assignment: to affiliates without consent, to others only with the consent of the {rb}.",
        f"The {ra} may transfer this agreement to an affiliate; "
        f"any other assignment needs the consent of the {rb}.",
        f"Transfers to affiliates are free for the {ra}; other transfers need approval of the {rb}.",
        f"Assignment by the {ra}: to affiliates without consent, to anyone else only with consent of the "
        f"{rb}.",
        f"The {ra} can transfer this agreement to its affiliates; a transfer to anyone else requires the "
        f"consent of the {rb}.",
        f"Without the consent of the {rb}, the {ra} may assign this agreement only to its affiliates.",
    )[p]


CLAUSES = {  # the clause types after the parties line, in the order a contract may list them
    "term": _term,
    "termination": _termination,
    "liability": _liability,
    "law": _law,
    "payment": _payment,
    "confidentiality": _confidentiality,
    "assignment": _assignment,
}


CLAUSES_PER_CONTRACT = 4  # after the parties line: short contracts keep CPU training affordable

# Section headings (the ``headings`` option of the corpus): the same in every phrasing and split, a
# keyword a question about the clause repeats (``worker.training.corpus``), so finding the clause a
# question asks about is matching a token rather than a paraphrase.
HEADINGS = {
    "term": "Term and Renewal",
    "termination": "Termination",
    "liability": "Limitation of Liability",
    "law": "Governing Law",
    "payment": "Payment",
    "confidentiality": "Confidentiality",
    "assignment": "Assignment",
}


def render_contract(
    facts: ContractFacts,
    rng: random.Random,
    phrasings: tuple[int, ...],
    required: tuple[str, ...] = (),
    headings: bool = False,
) -> str:
    """The contract text: the parties line, then ``CLAUSES_PER_CONTRACT`` clauses (the ``required``
    ones and others drawn at random) in a shuffled order, numbered, each in a phrasing drawn from
    ``phrasings``; ``headings``: each clause opens with its ``HEADINGS`` entry ("3. Termination.
    The Buyer ..."), the same random draws either way."""
    others = [name for name in CLAUSES if name not in required]
    order = list(dict.fromkeys(required)) + rng.sample(
        others, max(0, CLAUSES_PER_CONTRACT - len(set(required)))
    )
    rng.shuffle(order)
    lines = [_parties(facts, rng.choice(phrasings))]
    lines += [
        f"{i}. {HEADINGS[name] + '. ' if headings else ''}{CLAUSES[name](facts, rng.choice(phrasings))}"
        for i, name in enumerate(order, 1)
    ]
    return "\n".join(lines)
