"""The cffi binding against the real built engine: declarations match the header, outputs match the server."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from kvmem_llama.binding import Llama, ffi, load_library
from kvmem_llama.binding.cdef import CDEF, STRUCTS
from kvmem_llama.engine import Engine

pytestmark = pytest.mark.engine

PROMPT = "The three primary colors are"
N_TOKENS = 24


def declared_prototypes() -> list[tuple[str, str, str]]:
    """(return type, name, parameters) of every function the cdef declares, verbatim."""
    flat = " ".join(line for line in CDEF.splitlines() if not line.lstrip().startswith(("typedef", "//")))
    protos = []
    for statement in re.sub(r"\s+", " ", flat).split(";"):
        match = re.fullmatch(r"\s*([A-Za-z_][\w ]*?[\w*]\s*\**)\s*\b((?:llama|ggml)_\w+)\s*\(([^()]*)\)\s*", statement)
        if match:
            protos.append((match.group(1).strip(), match.group(2), match.group(3)))
    return protos


def c_compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    pytest.fail("no C compiler to check the declarations against the header")


def test_structs_and_functions_match_the_built_header(cpu_engine: Engine, tmp_path: Path) -> None:
    lib = load_library(cpu_engine.libllama)
    lines = ['#include "llama.h"', "#include <stdio.h>", "#include <stddef.h>"]
    expected: list[str] = []
    # every declared function must exist in the library and have exactly the header's type
    prototypes = declared_prototypes()
    assert len(prototypes) == len(re.findall(r"\b(?:llama|ggml)_\w+\s*\(", CDEF)) > 40
    for ret, name, params in prototypes:
        getattr(lib, name)  # raises if the library does not export it
        lines.append(f"{ret} (*check_{name})({params}) = &{name};")
    lines.append("int main(void) {")
    for struct in STRUCTS:
        lines.append(f'  printf("%s %zu\\n", "{struct}", sizeof({struct}));')
        expected.append(f"{struct} {ffi.sizeof(struct)}")
        for field, _ in ffi.typeof(struct).fields:
            lines.append(f'  printf("%s.%s %zu\\n", "{struct}", "{field}", offsetof({struct}, {field}));')
            expected.append(f"{struct}.{field} {ffi.offsetof(struct, field)}")
    lines += ["  return 0;", "}"]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    build = subprocess.run(
        [c_compiler(), "-std=c11", "-Werror=incompatible-pointer-types", "-Werror=int-conversion",
         "-Wno-deprecated-declarations", f"-I{cpu_engine.include_dir}", str(source), "-o", str(exe),
         f"-L{cpu_engine.libllama.parent}", "-lllama", "-lggml", f"-Wl,-rpath,{cpu_engine.libllama.parent}"],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, f"the cdef disagrees with the built llama.h:\n{build.stderr}"
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert got == expected


def test_binding_greedy_equals_server_completion(cpu_engine: Engine, smollm2: Path, llama_server) -> None:
    with Llama.load(smollm2, n_ctx=2048, libllama=cpu_engine.libllama) as llm:
        ours = llm.generate(PROMPT, max_tokens=N_TOKENS, temperature=0.0)
        assert llm.n_ctx_train == 8192 and llm.n_layer == 30
        assert llm.detokenize(llm.tokenize("hello world", add_special=False)) == "hello world"
    assert len(ours.tokens) > 0
    with llama_server(smollm2, ["-c", "2048", "-np", "1"]) as srv:
        reply = httpx.post(f"{srv.url}/completion", timeout=120, json={
            "prompt": PROMPT, "n_predict": N_TOKENS, "temperature": 0.0, "return_tokens": True,
            "cache_prompt": False, "seed": 0,
        }).json()
    assert reply["tokens"] == ours.tokens, (reply["content"], ours.text)
    assert reply["content"] == ours.text


def test_binding_reports_a_missing_model_clearly(cpu_engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(Exception, match="model file not found"):
        Llama.load(tmp_path / "nope.gguf", libllama=cpu_engine.libllama)


def test_binding_reports_a_non_gguf_file(cpu_engine: Engine, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(Exception, match="could not load"):
        Llama.load(bogus, libllama=cpu_engine.libllama)
