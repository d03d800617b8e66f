"""`kvmem eval`: long-context recall (RULER-style) against an endpoint or servers it starts itself."""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmem_llama import plots
from kvmem_llama.cli.console import console
from kvmem_llama.errors import KvmemError
from kvmem_llama.evaluation import corpus
from kvmem_llama.evaluation.client import EvalClient
from kvmem_llama.evaluation.records import RESULTS, load_records
from kvmem_llama.evaluation.report import Summary, columns, length_label, record_run, render, rows, to_json
from kvmem_llama.evaluation.runner import Evaluation, Item, Plan
from kvmem_llama.evaluation.servers import parse_budgets, parse_length
from kvmem_llama.evaluation.tasks import ALIASES, TASKS, parse_depths, parse_tasks

DEFAULT_TASKS = "niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe"


class ProgressReporter:
    """Feeds the runner's events to a rich progress bar."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task_id = progress.add_task("evaluating", total=None, score="")
        self.scores: list[float] = []

    def begin(self, total: int, done: int) -> None:
        self.progress.update(self.task_id, total=total, completed=done)
        if done:
            self.progress.console.print(f"[dim]resuming: {done} of {total} samples already in the results[/]")

    def server(self, config: str, length: int | None, url: str | None) -> None:
        at = f" for {length_label(length)}" if length else ""
        if url is None:
            self.progress.update(self.task_id, description=f"[{config}] starting server{at}")
        else:
            self.progress.console.print(f"[dim]server [{config}]{at} ready at {url}[/]")

    def sample(self, item: Item, config: str) -> None:
        depth = f" @{item.depth}%" if item.depth is not None else ""
        self.progress.update(self.task_id, description=f"[{config}] {item.task} {length_label(item.length)}{depth} "
                                                       f"#{item.index}")

    def result(self, record: dict) -> None:
        self.scores.append(record["score"])
        avg = sum(self.scores) / len(self.scores)
        self.progress.update(self.task_id, advance=1, score=f"mean {avg:.0f}")


def _summary_table(summary: Summary) -> Table:
    table = Table(title="kvmem eval: score, mean [95% Wilson] (samples)"
                  + ("; hit = answer blocks resident after the turn selection" if summary.has_hits else ""),
                  show_lines=False)
    table.add_column("configuration")
    table.add_column("task")
    for head in columns(summary):
        table.add_column(head, justify="right")
    for i, row in enumerate(rows(summary)):
        if i and row.task == summary.tasks[0]:
            table.add_section()
        if row.task is not None:
            table.add_row(row.config, row.task, *row.cells)
            continue
        lat = summary.latency.get(row.config)
        label = f"[bold]average[/] [dim]({lat:.1f} s/sample)[/]" if lat else "[bold]average[/]"
        table.add_row(f"[bold]{row.config}[/]", label, *row.shown(lambda c: f"[bold]{c}[/]"))
    return table


def _show_report(out: Path, order: list[str] | None = None) -> None:
    summary, files = render(out, order)
    console.print(_summary_table(summary))
    for f in files:
        console.print(f"[dim]wrote[/] {f}")
    if not plots.available():
        console.print(plots.skipped("accuracy_vs_length.png and depth_heatmap.png"), style="yellow", markup=False,
                      soft_wrap=True)


@click.group("eval", invoke_without_command=True, context_settings={"max_content_width": 110})
@click.option("--endpoint", metavar="URL", help="Root URL of a running OpenAI-compatible server (http://host:port).")
@click.option("--model", "model_id", metavar="ID", help="Model id to request (default: the server's first model).")
@click.option("--label", metavar="NAME",
              help="Configuration name for an --endpoint run in results and plots (default: 'endpoint').")
@click.option("--run", "run_model", metavar="MODEL",
              help="Start servers itself for MODEL (a GGUF path or a shipped name, e.g. qwen2.5-coder:0.5b).")
@click.option("--budgets", default="0", show_default=True,
              help="With --run: configurations to compare, [METHOD:]BUDGET[:key=value...]. 0 = tiering off; "
                   "1/8 = an eighth of the length; 2048 = tokens; 'recency:1/8' picks the method; each key=value "
                   "is passed as --kvmem-<key> <value> (retrieval:1/8:query-tokens=128).")
@click.option("--method", default="retrieval", show_default=True,
              help="With --run: --kvmem-method for entries without a METHOD: prefix (any name the engine has).")
@click.option("--server-arg", "--server-args", "server_args", multiple=True, metavar="ARGS",
              help="With --run: extra llama-server flags for every server (shell-quoted, repeatable), "
                   "e.g. --server-args '-ngl 99 -t 4'.")
@click.option("--engine", metavar="KEY",
              help="With --run: the engine (a key of `kvmem engines`, cpu or gpu; default: the one for this GPU).")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(1),
              help="With --run: servers (configurations) to run at once, each with its own port and log.")
@click.option("--server-log", type=click.Path(dir_okay=False, path_type=Path),
              help="With --endpoint: the server's log file, for the answer-block hit rate (needs -np 1 and "
                   "--kvmem-trace -lv 4 on the server).")
@click.option("--tasks", "tasks_spec", default=DEFAULT_TASKS, show_default=True,
              help="Comma list of tasks or groups (see `kvmem eval tasks`).")
@click.option("--lengths", default="4k,8k", show_default=True, help="Context lengths in tokens (4k = 4096).")
@click.option("--depths", default="10,50,90", show_default=True,
              help="Needle depths in percent of the context, or spread10 (= 5,15,...,95).")
@click.option("--samples", default=2, show_default=True, type=click.IntRange(1),
              help="Samples per depth: a cell gets samples x depths (3 x spread10 = 30); tasks without a depth "
                   "get as many.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed: same seed, same prompts.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("kvmem-eval"),
              show_default=True, help="Output folder (results.jsonl, summary.md, PNGs). Reruns resume.")
@click.option("--timeout", default=1800.0, show_default=True, type=click.FloatRange(1),
              help="Seconds to wait for one answer.")
@click.option("--api-key", envvar="OPENAI_API_KEY", help="Bearer token for --endpoint (env OPENAI_API_KEY).")
@click.pass_context
def eval_group(ctx: click.Context, endpoint: str | None, model_id: str | None, label: str | None,
               run_model: str | None, budgets: str, method: str, server_args: tuple[str, ...], engine: str | None,
               jobs: int,
               server_log: Path | None, tasks_spec: str, lengths: str, depths: str, samples: int, seed: int,
               out_dir: Path, timeout: float, api_key: str | None) -> None:
    """Measure long-context recall: RULER-style tasks, generated offline, sized by the server's tokenizer.

    \b
    Against a running server:
      kvmem eval --endpoint http://127.0.0.1:8080 --lengths 4k,8k --samples 3
    Starting servers itself and comparing KV budgets (0 = tiering off):
      kvmem eval --run qwen2.5-coder:0.5b --budgets 0,1/8,1/16,recency:1/8 --lengths 8k,16k
    A method ablation at 1/8, 30 samples per cell, 3 servers at once:
      kvmem eval --run MODEL --budgets retrieval:1/8,recency:1/8,0 --depths spread10 --samples 3 --jobs 3
    Redraw the table and plots of a results folder:
      kvmem eval report kvmem-eval

    Each answered sample is one line of OUT/results.jsonl, written at once; Ctrl-C keeps
    everything answered so far and the same command resumes where it stopped.
    """
    if ctx.invoked_subcommand is not None:
        return
    if bool(endpoint) == bool(run_model):
        raise click.UsageError("give either --endpoint URL (a running server) or --run MODEL (start servers)")
    if endpoint and (budgets != "0" or server_args or jobs != 1 or engine):
        raise click.UsageError("--budgets, --server-args, --engine and --jobs need --run (with --endpoint the "
                               "server is yours: name its configuration with --label)")
    if run_model and server_log:
        raise click.UsageError("--server-log is for --endpoint; with --run the harness reads its servers' logs")
    plan = Plan(parse_tasks(tasks_spec), [parse_length(x) for x in lengths.split(",") if x.strip()],
                parse_depths(depths), samples, seed)
    configs = parse_budgets(budgets, method) if run_model else []
    extra = [a for arg in server_args for a in shlex.split(arg)]
    out_dir.mkdir(parents=True, exist_ok=True)
    record_run(out_dir, {"argv": ["kvmem", *sys.argv[1:]],
                          "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                          "tasks": plan.tasks, "lengths": plan.lengths, "depths": plan.depths, "samples": samples,
                          "seed": seed, "jobs": jobs, "corpus": corpus.corpus_info(),
                          "configs": [c.label for c in configs] if run_model else [label or "endpoint"]})
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[score]}"), TimeElapsedColumn(), console=console, transient=False)
    reporter = ProgressReporter(progress)
    evaluation = Evaluation(plan, out_dir, reporter)
    try:
        with progress:
            if endpoint:
                with EvalClient(endpoint, model_id, timeout=timeout, api_key=api_key) as client:
                    for _ in evaluation.run_endpoint(client, label or "endpoint", server_log=server_log):
                        pass
            else:
                assert run_model is not None
                for _ in evaluation.run_configs(run_model, configs, out_dir / "logs", extra, timeout, jobs=jobs,
                                                engine=engine):
                    pass
    except KeyboardInterrupt:
        kept = len(load_records(out_dir))
        console.print(f"[yellow]interrupted[/]: {kept} results kept in {out_dir / RESULTS}; "
                      "run the same command again to resume")
        if kept:
            _show_report(out_dir)
        raise
    _show_report(out_dir)


@eval_group.command("report")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (the numbers of summary.json).")
def report_cmd(out_dir: Path, as_json: bool) -> None:
    """Re-render the summary table, summary.md, summary.json and PNG plots from OUT_DIR/results.jsonl."""
    if not (out_dir / RESULTS).exists():
        raise KvmemError(f"{out_dir / RESULTS} does not exist", hint="pass the --out folder of a `kvmem eval` run")
    if as_json:
        summary, _ = render(out_dir)
        click.echo(json.dumps(to_json(summary), indent=2))
        return
    _show_report(out_dir)


@eval_group.command("tasks")
def tasks_cmd() -> None:
    """List the tasks and task groups."""
    table = Table(title="kvmem eval tasks")
    table.add_column("task")
    table.add_column("what")
    table.add_column("depth", justify="center")
    table.add_column("max answer", justify="right")
    for t in TASKS.values():
        table.add_row(t.name, t.description, "yes" if t.uses_depth else "-", str(t.max_tokens))
    console.print(table)
    for name, members in ALIASES.items():
        console.print(f"[bold]{name}[/] = {', '.join(members)}")


COMMANDS: list[click.Command] = [eval_group]
