"""`kvmem eval`: an offline RULER-style long-context harness for any OpenAI-compatible server.

Tasks are generated locally (seeded, nothing downloaded), sized with the server's own
tokenizer, answered through `/v1/chat/completions`, scored by substring match, and written as
JSON lines that `report.render` turns into a table and PNG plots.
"""

from kvmem_llama.evaluation.client import EvalClient
from kvmem_llama.evaluation.records import load_records
from kvmem_llama.evaluation.runner import Evaluation, Item, Plan
from kvmem_llama.evaluation.scoring import score
from kvmem_llama.evaluation.servers import Config, parse_budgets, parse_length
from kvmem_llama.evaluation.stats import Estimate, estimate, wilson
from kvmem_llama.evaluation.tasks import TASKS, Sample, fit_sample, parse_depths, parse_tasks

__all__ = ["EvalClient", "Evaluation", "Item", "Plan", "load_records", "score", "Config", "parse_budgets",
           "parse_length", "Estimate", "estimate", "wilson", "TASKS", "Sample", "fit_sample", "parse_depths",
           "parse_tasks"]
