"""`kvmem vendor ...`: the pin, the upstream cache, and the patch-series edit loop."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from kvmem_llama import paths
from kvmem_llama.build import tree_root
from kvmem_llama.cli.console import console, human_bytes
from kvmem_llama.errors import KvmemError
from kvmem_llama.packaging import pack_source, unpack_source
from kvmem_llama.patches import PATCHES_DIR
from kvmem_llama.patching import create_edit_tree, export_edit_tree, load_series, patch_subject
from kvmem_llama.vendor import load_pin
from kvmem_llama.vendor.fetch import VERIFIED_MARKER, sdist_path, upstream_tree


def _say(msg: str) -> None:
    console.print(f"[dim]•[/] {msg}")


@click.group()
def vendor() -> None:
    """The pinned upstream llama.cpp and our patch series (for maintainers)."""


@vendor.command()
def fetch() -> None:
    """Download the pinned sdist with pip, verify size + sha256, extract llama.cpp."""
    pin = load_pin()
    tree = upstream_tree(paths.cache_dir(), pin, _say)
    console.print(f"[green]verified[/] {pin.requirement} (sha256 {pin.sha256[:16]}…) → {tree}")


@vendor.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def status(as_json: bool) -> None:
    """Show the pin, what is cached, and the hash of the patch series."""
    pin = load_pin()
    series = load_series()
    cache = paths.cache_dir()
    sdist = sdist_path(cache, pin)
    upstream = cache / "upstream" / pin.short
    patched = tree_root(pin, series) / "src"
    data = {
        "upstream": f"llama.cpp {pin.upstream_version} (commit {pin.upstream_commit})",
        "carrier": pin.requirement,
        "sha256": pin.sha256,
        "size": pin.size,
        "sdist_cached": sdist.exists(),
        "upstream_tree": str(upstream) if (upstream / VERIFIED_MARKER).exists() else None,
        "patched_tree": str(patched) if patched.exists() else None,
        "series_hash": series.hash(),
        "patches": [{"name": n, "subject": patch_subject(series.directory / n)} for n in series.names],
        "overlay": [p.as_posix() for p in series.overlay_files()],
        "patches_dir": str(series.directory),
    }
    if as_json:
        console.print_json(data=data)
        return
    table = Table(show_header=False, box=None)
    table.add_row("upstream", data["upstream"])
    table.add_row("carried by", f"{pin.requirement} ({human_bytes(pin.size)}, sha256 {pin.sha256[:16]}…)")
    table.add_row("sdist cache", str(sdist) if data["sdist_cached"] else "[yellow]not downloaded[/]")
    table.add_row("upstream tree", data["upstream_tree"] or "[yellow]not extracted[/]")
    table.add_row("patched tree", data["patched_tree"] or "[yellow]not prepared[/]")
    table.add_row("series hash", data["series_hash"])
    table.add_row("patches dir", data["patches_dir"])
    console.print(table)
    for entry in data["patches"]:
        console.print(f"  [cyan]{entry['name']}[/]  {entry['subject']}")
    for rel in data["overlay"]:
        console.print(f"  [magenta]overlay[/] {rel}")


@vendor.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def edit(directory: Path) -> None:
    """Make DIRECTORY a git work tree: upstream, overlay and each patch as commits.

    Edit, commit (one commit per patch; new files become overlay files), then run
    `kvmem vendor export DIRECTORY`.
    """
    pin = load_pin()
    upstream = upstream_tree(paths.cache_dir(), pin, _say)
    series = load_series()
    label = f"llama.cpp {pin.upstream_version} ({pin.upstream_commit}) from {pin.requirement}"
    state = create_edit_tree(upstream, series, directory, label)
    console.print(f"[green]ready[/] {directory}: upstream {state['upstream'][:10]}, "
                  f"overlay {state['overlay'][:10]}, {len(series.names)} patch commit(s)")


def _repo_patches_dir() -> Path:
    # Exporting writes into the source checkout; an installed (non-editable) package has none.
    if not (PATCHES_DIR.parent / "setup.py").exists():
        raise KvmemError(f"{PATCHES_DIR} is not inside a source checkout",
                         hint="pass --patches-dir PATH_TO_CHECKOUT/patches")
    return PATCHES_DIR


@vendor.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--patches-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where to write the series (default: this checkout's patches/).")
def export(directory: Path, patches_dir: Path | None) -> None:
    """Write DIRECTORY's commits back as patches/series, *.patch and patches/overlay/."""
    target = patches_dir or _repo_patches_dir()
    target.mkdir(parents=True, exist_ok=True)
    series = export_edit_tree(directory, target)
    console.print(f"[green]exported[/] {len(series.names)} patch(es), {len(series.overlay_files())} overlay "
                  f"file(s) to {target}; series hash {series.hash()[:12]}")


@vendor.command()
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path(".kvmem"),
              show_default=True, help="Directory for the tarball (git-ignored by default).")
@click.option("--upstream", is_flag=True, help="Pack the bare pin (no patches), for `kvmem build --upstream`.")
def pack(out_dir: Path, upstream: bool) -> None:
    """Write the patched tree as a compact tar.xz, for a build host with no registry access."""
    tarball = pack_source(out_dir, upstream)
    console.print(f"[green]packed[/] {tarball} ({human_bytes(tarball.stat().st_size)})")


@vendor.command()
@click.argument("pack_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def unpack(pack_file: Path) -> None:
    """Use a source pack made by `kvmem vendor pack` (same commit) as the tree to build."""
    src = unpack_source(pack_file)
    console.print(f"[green]unpacked[/] {pack_file.name} → {src}; now run `kvmem build`")


COMMANDS = [vendor]
