"""Our patch series: strict application, its hash, and the maintainer's edit/export loop.

A series is `patches/series` (ordered file names, `#` comments), the `*.patch` files it
names (unified diffs, git style, with a `Subject:` header), and `patches/overlay/`
(whole files of ours, copied into the tree before any patch).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvmem_llama.errors import KvmemError, PatchError
from kvmem_llama.patches import PATCHES_DIR

HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
EDIT_STATE = "kvmem-edit.json"


@dataclass
class Hunk:
    header: str
    old_start: int
    lines: list[str] = field(default_factory=list)  # with their ' ', '-', '+' prefix

    @property
    def old(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[:1] in (" ", "-")]

    @property
    def new(self) -> list[str]:
        return [ln[1:] for ln in self.lines if ln[:1] in (" ", "+")]


@dataclass
class FilePatch:
    old_path: str | None  # None: file is created
    new_path: str | None  # None: file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or "?"


@dataclass
class Series:
    directory: Path
    names: list[str]
    # the hash as first computed: a build keys its tree, build dir and engine by it from start to end, even when the
    # files are edited meanwhile (patched_tree checks that the tree it made is the one hashed)
    _digest: str | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def overlay_dir(self) -> Path:
        return self.directory / "overlay"

    def overlay_files(self) -> list[Path]:
        """Overlay files as paths relative to the overlay root, sorted."""
        if not self.overlay_dir.is_dir():
            return []
        return sorted(
            p.relative_to(self.overlay_dir)
            for p in self.overlay_dir.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        )

    def hash(self) -> str:
        """sha256 over the series, every patch and every overlay file (path + bytes), as they were at this
        object's first call (`load_series` again for the files as they are now)."""
        if self._digest is None:
            self._digest = self._hash_files()
        return self._digest

    def _hash_files(self) -> str:
        digest = hashlib.sha256()
        for name in self.names:
            digest.update(f"patch:{name}\n".encode())
            digest.update((self.directory / name).read_bytes())
        for rel in self.overlay_files():
            digest.update(f"overlay:{rel.as_posix()}\n".encode())
            digest.update((self.overlay_dir / rel).read_bytes())
        return digest.hexdigest()


def load_series(directory: Path = PATCHES_DIR) -> Series:
    series_file = directory / "series"
    if not series_file.exists():
        raise PatchError(f"no series file in {directory}")
    names = []
    for raw in series_file.read_text(encoding="utf-8").splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or not name.endswith(".patch"):
            raise PatchError(f"{series_file}: bad entry {name!r} (a *.patch file name in {directory})")
        if not (directory / name).exists():
            raise PatchError(f"{series_file} lists {name}, which does not exist in {directory}")
        names.append(name)
    return Series(directory, names)


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def parse_patch(text: str, name: str = "<patch>") -> list[FilePatch]:
    """Parse a unified diff into file patches. Lines before the first `---` are the message."""
    files: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]))
            files.append(current)
            i += 2
            continue
        match = HUNK_HEADER.match(line)
        if match:
            if not files:
                raise PatchError(f"{name}: hunk before any file header at line {i + 1}")
            old_count = int(match.group(2) or 1)
            new_count = int(match.group(4) or 1)
            hunk = Hunk(line, int(match.group(1)))
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_count or seen_new < new_count):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag = body[:1] or " "  # an empty line is an empty context line
                if tag not in " -+":
                    raise PatchError(f"{name}: malformed hunk {hunk.header} at line {i + 1}: {body!r}")
                hunk.lines.append(tag + body[1:])
                seen_old += tag in " -"
                seen_new += tag in " +"
                i += 1
            if seen_old != old_count or seen_new != new_count:
                raise PatchError(f"{name}: hunk {hunk.header} is truncated")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError(f"{name}: contains no diff")
    return files


def _find_hunk(content: list[str], hunk: Hunk, offset: int) -> int | None:
    """Where the hunk's old lines sit: at the stated line, else the nearest exact match."""
    old = hunk.old
    expected = max(hunk.old_start - 1, 0) + offset
    limit = len(content) - len(old)
    if not old:  # pure insertion: "@@ -N,0" inserts after line N
        return min(hunk.old_start + offset, len(content))
    for distance in range(0, len(content) + 1):
        for pos in (expected - distance, expected + distance):
            if 0 <= pos <= limit and content[pos:pos + len(old)] == old:
                return pos
        if expected - distance < 0 and expected + distance > limit:
            break
    return None


def _first_mismatch(content: list[str], hunk: Hunk, offset: int) -> str:
    """Say where the hunk expected what: the first line that differs at its stated place."""
    start = max(hunk.old_start - 1, 0) + offset
    for i, wanted in enumerate(hunk.old):
        found = content[start + i] if start + i < len(content) else "<end of file>"
        if found != wanted:
            return f"line {start + i + 1} should be {wanted.strip()!r} but is {found.strip()!r}"
    return "its context is not in the file"


def apply_file_patch(tree: Path, fp: FilePatch, patch_name: str) -> None:
    target = tree / fp.path
    if fp.old_path is None:
        if target.exists():
            raise PatchError(f"{patch_name}: creates {fp.path}, which already exists in the tree")
        content: list[str] = []
        trailing_newline = True
    else:
        if not target.exists():
            raise PatchError(f"{patch_name}: patches {fp.path}, which does not exist in the tree")
        text = target.read_text(encoding="utf-8")
        trailing_newline = text.endswith("\n")
        content = text.splitlines()
    offset = 0
    for number, hunk in enumerate(fp.hunks, 1):
        pos = _find_hunk(content, hunk, offset)
        if pos is None:
            raise PatchError(
                f"{patch_name}: hunk #{number} ({hunk.header}) does not apply to {fp.path}: "
                f"{_first_mismatch(content, hunk, offset)}",
                hint="the pin or an earlier patch changed this spot: fix it with "
                "`kvmem vendor edit DIR`, then `kvmem vendor export DIR`",
            )
        content[pos:pos + len(hunk.old)] = hunk.new
        # later hunks' line numbers are in old-file terms: carry the shift forward
        offset = pos - (hunk.old_start - 1) + len(hunk.new) - len(hunk.old)
    if fp.new_path is None:
        target.unlink()
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(content) + ("\n" if trailing_newline and content else ""), encoding="utf-8")


def apply_patch(tree: Path, patch_file: Path) -> list[str]:
    """Apply one patch strictly; every hunk must match exactly (no fuzz). Returns touched files."""
    files = parse_patch(patch_file.read_text(encoding="utf-8"), patch_file.name)
    for fp in files:
        apply_file_patch(tree, fp, patch_file.name)
    return [fp.path for fp in files]


def copy_overlay(series: Series, tree: Path) -> list[str]:
    copied = []
    for rel in series.overlay_files():
        dest = tree / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(series.overlay_dir / rel, dest)
        copied.append(rel.as_posix())
    return copied


def apply_series(tree: Path, series: Series) -> None:
    """Copy the overlay into `tree`, then apply every patch in order; stop at the first failure."""
    copy_overlay(series, tree)
    for name in series.names:
        apply_patch(tree, series.directory / name)


def patch_subject(patch_file: Path) -> str:
    for line in patch_file.read_text(encoding="utf-8").splitlines():
        if line.startswith("Subject:"):
            return line[len("Subject:"):].strip()
        if line.startswith(("diff ", "--- ")):
            break
    return patch_file.stem


def patch_message(patch_file: Path) -> str:
    """The commit message of a patch: everything above its `---` separator, minus `Subject:`."""
    lines = patch_file.read_text(encoding="utf-8").splitlines()
    message: list[str] = []
    for line in lines:
        if line == "---" or line.startswith(("diff --git", "--- ")):
            break
        message.append(line[len("Subject:"):].strip() if line.startswith("Subject:") else line)
    return "\n".join(message).strip() or patch_file.stem


# --- the maintainer loop: a git work tree with upstream, overlay and each patch as commits ---


def _git(repo: Path, *args: str, input_text: str | None = None) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, input=input_text
    )
    if proc.returncode != 0:
        raise KvmemError(f"git {' '.join(args)} failed in {repo}:\n{proc.stderr.strip()}")
    return proc.stdout


def _commit_all(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-F", "-", input_text=message + "\n")
    return _git(repo, "rev-parse", "HEAD").strip()


def create_edit_tree(upstream: Path, series: Series, dest: Path, upstream_label: str) -> dict:
    """Make `dest` a git repo: upstream commit, overlay commit, one commit per patch."""
    if shutil.which("git") is None:
        raise KvmemError("git is not installed; the edit loop needs it", hint="apt-get install git")
    if dest.exists() and any(dest.iterdir()):
        raise KvmemError(f"{dest} exists and is not empty", hint="choose a new directory")
    # upstream ships a stray `.git` file (it was a submodule there); our repo must own .git
    shutil.copytree(upstream, dest, ignore=shutil.ignore_patterns(".kvmem-upstream.json", ".git"))
    _git(dest, "init", "-q", "-b", "kvmem")
    _git(dest, "config", "user.name", "kvmem maintainer")
    _git(dest, "config", "user.email", "kvmem@localhost")
    _git(dest, "config", "core.autocrlf", "false")
    upstream_commit = _commit_all(dest, f"upstream: {upstream_label}")
    copy_overlay(series, dest)
    overlay_commit = _commit_all(dest, "kvmem overlay: whole files of ours (patches/overlay)")
    for name in series.names:
        apply_patch(dest, series.directory / name)
        _commit_all(dest, patch_message(series.directory / name))
    state = {
        "upstream": upstream_commit,
        "overlay": overlay_commit,
        "overlay_files": [p.as_posix() for p in series.overlay_files()],
        "label": upstream_label,
    }
    (dest / ".git" / EDIT_STATE).write_text(json.dumps(state, indent=2), encoding="utf-8")
    return state


def _slug(subject: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return slug[:60].rstrip("-") or "change"


def export_edit_tree(repo: Path, patches_dir: Path) -> Series:
    """Write the work tree's commits back as overlay files + a numbered patch series."""
    state_file = repo / ".git" / EDIT_STATE
    if not state_file.exists():
        raise KvmemError(f"{repo} is not a work tree made by `kvmem vendor edit`")
    state = json.loads(state_file.read_text(encoding="utf-8"))
    if _git(repo, "status", "--porcelain").strip():
        raise KvmemError(f"{repo} has uncommitted changes", hint="commit them (one commit per patch), then export")

    # Files that upstream does not have are ours: they live in overlay/, not in diffs.
    added = _git(repo, "diff", "--name-only", "--diff-filter=A", state["upstream"], "HEAD").split()
    overlay_files = sorted(set(added))

    commits = _git(repo, "rev-list", "--reverse", f"{state['overlay']}..HEAD").split()
    excludes = [f":(exclude){path}" for path in overlay_files]
    new_patches: dict[str, str] = {}
    for commit in commits:
        diff = _git(repo, "diff", "--no-renames", "--no-color", f"{commit}^", commit, "--", ".", *excludes)
        if not diff.strip():
            continue
        message = _git(repo, "log", "-1", "--format=%B", commit).strip()
        subject, _, body = message.partition("\n")
        name = f"{len(new_patches) + 1:04d}-{_slug(subject)}.patch"
        header = f"Subject: {subject}\n" + (f"\n{body.strip()}\n" if body.strip() else "")
        new_patches[name] = f"{header}---\n{diff}"

    overlay_root = patches_dir / "overlay"
    if overlay_root.exists():
        shutil.rmtree(overlay_root)
    for rel in overlay_files:
        dest = overlay_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, dest)
    for old in patches_dir.glob("*.patch"):
        if old.name not in new_patches:
            old.unlink()
    for name, text in new_patches.items():
        (patches_dir / name).write_text(text, encoding="utf-8")
    series_text = "# Our patch series, applied in this order after patches/overlay/ is copied in.\n"
    series_text += "".join(f"{name}\n" for name in new_patches)
    (patches_dir / "series").write_text(series_text, encoding="utf-8")
    return load_series(patches_dir)
