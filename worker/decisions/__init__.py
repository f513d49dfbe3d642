"""The decision service: structured multiple-choice answers decoded by template infilling.

Pure code over the engine contract (``worker.engine.types``): it builds prompts and infill
templates, turns engine results into an always-valid answer list and validates free text. It
imports neither Celery nor SQL; the Celery task hands it a ``submit`` callable into the engine.
"""

from worker.decisions.assemble import InvalidModelOutput, assemble_result
from worker.decisions.planner import DecisionPlan, plan_decision
from worker.decisions.runner import DecisionFaults, run_decision
from worker.decisions.spec import DecisionQuestion, DecisionSpec

__all__ = [
    "DecisionFaults",
    "DecisionPlan",
    "DecisionQuestion",
    "DecisionSpec",
    "InvalidModelOutput",
    "assemble_result",
    "plan_decision",
    "run_decision",
]
