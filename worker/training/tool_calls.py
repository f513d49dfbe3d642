"""Tool-call examples of the demo corpus: a contract, a request, and the call an agent should make.

The headline use of the model is tool calling, through the OpenAI-compatible routes: a chat with
``tools`` (the chat template renders them into the system turn) and ``tool_choice`` ``auto``, the
answer read by the format's parser (``worker/structured/tool_parsers.py``). The corpus asks for
three office actions on a contract, each with one argument the contract states:

- ``schedule_payment(days)``: the payment clause's days (an integer);
- ``send_copy(party)``: the name of the party in the role the request names ("to the Supplier");
- ``file_contract(law)``: the governing law's country;

and, in ``NO_CALL_SHARE`` of the cases, a question the contract answers in one line, which the
model should answer in text with the same tools on offer (an agent must also know when not to
call). The call target is the assistant turn as the chat template renders it, so training and the
parser agree on the format by construction. Plain Python.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.training.contracts import ContractFacts

NO_CALL_SHARE = 0.25
TOOL_TOKENS = 96  # new tokens of a tool-call job: a call is ~70 tokens (shipped tokenizer), 19 with tags


def _tool(name: str, description: str, argument: str, kind: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": kind}}, "required": [argument]},
    }}  # fmt: skip


TOOLS: tuple[dict[str, Any], ...] = (
    _tool("schedule_payment", "Pay an invoice this many days after it arrives.", "days", "integer"),
    _tool("send_copy", "Send a copy of the agreement to a party, by name.", "party", "string"),
    _tool("file_contract", "File the agreement under the country of its governing law.", "law", "string"),
)

# Each action's requests (a role is filled in for send_copy) and the clause that must be stated.
REQUESTS: dict[str, tuple[str, ...]] = {
    "schedule_payment": ("Schedule the payment of the invoice that just arrived.",
                         "Pay the new invoice when the agreement says it is due.",
                         "Book the payment of this invoice as the contract requires."),
    "send_copy": ("Send a copy of the agreement to the {role}.",
                  "Mail the signed contract to the {role}.",
                  "Please forward the agreement to the {role}."),
    "file_contract": ("File this agreement under its governing law.",
                      "Archive the contract by the law that governs it.",
                      "Put the agreement in the folder of its governing law."),
}  # fmt: skip
CLAUSE_OF: dict[str, str | None] = {"schedule_payment": "payment", "send_copy": None, "file_contract": "law"}


@dataclass(frozen=True)
class ToolCallCase:
    messages: tuple[dict[str, str], ...]
    call: tuple[str, dict[str, Any]] | None  # (function name, arguments), or None: answer in text
    answer: str  # the expected text of a case without a call ("" with one)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(TOOLS))  # a caller may change its copy, never the corpus's

    def job_input(self) -> dict[str, object]:
        """The body's ``input`` of a ``generate`` job asking this case (the OpenAI routes' shape)."""
        return {"messages": [dict(m) for m in self.messages], "tools": self.tools, "tool_choice": "auto"}

    def assistant_turn(self) -> dict[str, Any]:
        """The expected assistant message, as a chat template reads it (arguments as a mapping)."""
        if self.call is None:
            return {"role": "assistant", "content": self.answer}
        name, arguments = self.call
        call = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}


def draw_call(facts: ContractFacts, rng: random.Random) -> tuple[str, dict[str, Any], str, str | None]:
    """An action on ``facts``: (function, its arguments, the request, the clause it needs)."""
    name = rng.choice(sorted(REQUESTS))
    request = rng.choice(REQUESTS[name])
    if name == "schedule_payment":
        arguments: dict[str, Any] = {"days": facts.payment_days}
    elif name == "send_copy":
        side = rng.randrange(2)
        request = request.format(role=facts.roles[side])
        arguments = {"party": facts.names[side]}
    else:
        arguments = {"law": facts.law}
    return name, arguments, request, CLAUSE_OF[name]


def call_parts(call: Mapping[str, Any]) -> tuple[str | None, Any]:
    """(name, arguments) of an OpenAI-shaped call: ``arguments`` decoded from its JSON text (kept
    as given when it is not JSON), the id left out (it names the job that made the call)."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    try:
        return function.get("name"), json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return function.get("name"), arguments


def calls_seen(cases: list[ToolCallCase]) -> dict[str, int]:
    """How many cases expect each function (``none``: a text answer)."""
    counts: dict[str, int] = {}
    for case in cases:
        key = case.call[0] if case.call else "none"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
