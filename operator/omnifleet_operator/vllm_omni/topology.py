"""vLLM-Omni's pipeline topologies, read from its source without importing it.

vLLM-Omni defines each pipeline's fixed topology (stages, execution types,
input sources, stage input processors, sampling constraints) as Python
`PipelineConfig(...)` literals registered in `OMNI_PIPELINES`
(`vllm_omni/config/pipeline_registry.py`). Importing them needs vLLM, torch
and transformers; the importer must run without them, so this module
evaluates those literals statically (the `ast` of the source files: strings,
f-strings of module constants, tuples, dicts, enum members) and writes the
registry as data: `pipelines-<version>.yaml` beside this file, which the
importer reads. A registry entry that is a resolver function (chosen from the
model's HF config at serve time) maps to the pipeline its last `return`
names, the full variant, and is marked as such.

    python -m omnifleet_operator.vllm_omni.topology WHEEL_OR_DIR [-o FILE]

regenerates the data file (the unit test fails when it is stale).
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

DATA_DIR = Path(__file__).resolve().parent
REGISTRY = "vllm_omni/config/pipeline_registry.py"
STAGE_CONFIG = "vllm_omni/config/stage_config.py"

# The StagePipelineConfig fields the importer maps (others are not needed to run the stages).
STAGE_FIELDS = (
    "stage_id", "model_stage", "execution_type", "input_sources", "final_output", "final_output_type",
    "owns_tokenizer", "requires_multimodal_data", "hf_config_name", "engine_output_type", "model_arch",
    "retains_state_across_chunks", "sampling_constraints", "custom_process_input_func",
    "custom_process_next_stage_input_func", "async_chunk_process_next_stage_input_func",
    "sync_process_input_func", "supports_native_mrv2_data_plane", "prompt_transform_func",
    "prompt_expand_func", "cfg_kv_collect_func", "stage_input_payload_keys", "stage_output_payload_keys",
    "omni_kv_config", "scheduler_cls", "model_subdir", "tokenizer_subdir", "model_path_resolver",
    "inline_diffusion", "requires_full_payload_input", "extras",
)
PIPELINE_FIELDS = ("model_type", "model_arch", "default_deploy_config_name", "default_session_mode")


class Unevaluable(Exception):
    pass


class Source:
    """The .py files of a vLLM-Omni wheel or unpacked tree, by module name."""

    def __init__(self, location: Path):
        self.files: dict[str, str] = {}
        if location.is_file():
            with zipfile.ZipFile(location) as zf:
                for name in zf.namelist():
                    if name.startswith("vllm_omni/") and name.endswith(".py"):
                        self.files[name] = zf.read(name).decode()
                    elif name.endswith(".dist-info/METADATA"):
                        self.metadata = zf.read(name).decode()
        else:
            for path in location.rglob("vllm_omni/**/*.py"):
                self.files[path.relative_to(location).as_posix()] = path.read_text()
            meta = next(location.glob("vllm_omni-*.dist-info/METADATA"), None)
            self.metadata = meta.read_text() if meta else ""
        if REGISTRY not in self.files:
            raise SystemExit(f"{location}: no {REGISTRY}; not a vLLM-Omni wheel or tree")
        self.modules: dict[str, Module] = {}

    @property
    def version(self) -> str:
        for line in io.StringIO(self.metadata):
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        raise SystemExit("the wheel's METADATA names no version")

    def module(self, name: str) -> Module:
        if name not in self.modules:
            base = name.replace(".", "/")
            text = self.files.get(base + ".py") or self.files.get(base + "/__init__.py")
            if text is None:
                raise Unevaluable(f"no source for module {name}")
            self.modules[name] = Module(self, name, ast.parse(text))
        return self.modules[name]


class Module:
    """One parsed module: its top-level assignments and imports, evaluated on demand."""

    def __init__(self, source: Source, name: str, tree: ast.Module):
        self.source, self.name = source, name
        self.assigns: dict[str, ast.expr] = {}
        self.functions: dict[str, ast.FunctionDef] = {}
        self.imports: dict[str, tuple[str, str]] = {}
        self.values: dict[str, Any] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                self.assigns[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                self.assigns[node.target.id] = node.value
            elif isinstance(node, ast.FunctionDef):
                self.functions[node.name] = node
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                if node.level:
                    parts = name.split(".")[: -node.level]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (base, alias.name)

    def lookup(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        if name in self.assigns:
            value = self.values[name] = self.eval(self.assigns[name])
            return value
        if name in self.functions:
            return ("resolver", self, self.functions[name])
        if name in self.imports:
            module, attr = self.imports[name]
            if module.startswith("vllm_omni"):
                return self.source.module(module).lookup(attr)
        raise Unevaluable(f"{self.name}: cannot evaluate name {name}")

    def eval(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(self._fmt(v) for v in node.values)
        if isinstance(node, ast.Name):
            return self.lookup(node.id)
        if isinstance(node, (ast.Tuple, ast.List)):
            out: list[Any] = []
            for elt in node.elts:
                if isinstance(elt, ast.Starred):
                    out.extend(self.eval(elt.value))
                else:
                    out.append(self.eval(elt))
            return out
        if isinstance(node, ast.Dict):
            out_d: dict[Any, Any] = {}
            for k, v in zip(node.keys, node.values):
                if k is None:
                    out_d.update(self.eval(v))
                else:
                    out_d[self.eval(k)] = self.eval(v)
            return out_d
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "StageExecutionType":
                return node.attr.lower()
            if node.value.id in self.imports and not self.imports[node.value.id][0].startswith("vllm_omni"):
                # An enum member of vLLM's (RequestOutputKind.FINAL_ONLY): kept as its dotted path.
                module, cls = self.imports[node.value.id]
                return f"{module}.{cls}.{node.attr}"
            base = self.lookup(node.value.id)
            if isinstance(base, dict) and node.attr in base:  # OTHER_PIPELINE.stages
                return base[node.attr]
            raise Unevaluable(f"{self.name}: cannot evaluate {node.value.id}.{node.attr}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.eval(node.left) + self.eval(node.right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.eval(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn = node.func.id
            if fn in ("PipelineConfig", "StagePipelineConfig"):
                fields = PIPELINE_FIELDS + ("stages",) if fn == "PipelineConfig" else STAGE_FIELDS
                out_c: dict[str, Any] = {}
                for kw in node.keywords:
                    if kw.arg in fields:
                        out_c[kw.arg] = self.eval(kw.value)
                return out_c
            if fn in ("tuple", "list", "dict", "frozenset", "set") and not node.keywords and len(node.args) <= 1:
                return self.eval(node.args[0]) if node.args else ({} if fn == "dict" else [])
            if fn == "dict" and not node.args:
                return {kw.arg: self.eval(kw.value) for kw in node.keywords}
        raise Unevaluable(f"{self.name}: cannot evaluate {ast.dump(node)[:80]}")

    def _fmt(self, node: ast.expr) -> str:
        if isinstance(node, ast.Constant):
            return str(node.value)
        if isinstance(node, ast.FormattedValue):
            return str(self.eval(node.value))
        raise Unevaluable(f"{self.name}: f-string part {ast.dump(node)[:60]}")


def _resolver_default(module: Module, fn: ast.FunctionDef) -> tuple[dict[str, Any], list[str]]:
    """The pipeline a resolver function returns last (its default), and all it can return."""
    returns = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, ast.Name)),
                     key=lambda n: n.lineno)
    names = [n.value.id for n in returns]
    if not names:
        raise Unevaluable(f"{module.name}.{fn.name}: returns no named pipeline")
    return module.lookup(names[-1]), names


def _scheduler_paths(source: Source) -> dict[str, str]:
    """Dotted paths of the schedulers `_resolve_scheduler` picks, from stage_config's imports."""
    mod = source.module("vllm_omni.config.stage_config")
    out = {}
    for cls in ("OmniARScheduler", "OmniARAsyncScheduler", "OmniGenerationScheduler"):
        module, attr = mod.imports[cls]
        out[cls] = f"{module}.{attr}"
    return out


def extract(location: Path) -> dict[str, Any]:
    source = Source(location)
    registry = source.module("vllm_omni.config.pipeline_registry")
    table = registry.assigns["OMNI_PIPELINES"]
    if not isinstance(table, ast.Dict):
        raise SystemExit("OMNI_PIPELINES is not a dict literal")
    pipelines: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for k, v in zip(table.keys, table.values):
        key = registry.eval(k)
        try:
            value = registry.eval(v)
            if isinstance(value, tuple) and value[0] == "resolver":
                value, alternatives = _resolver_default(value[1], value[2])
                value = dict(value, resolver={"function": v.id, "default": alternatives[-1],
                                             "returns": sorted(set(alternatives))})
            pipelines[key] = value
        except Unevaluable as e:
            skipped[key] = str(e)
    return {
        "vllmOmniVersion": source.version,
        "schedulers": _scheduler_paths(source),
        "deploySchema": _deploy_schema(source),
        "pipelines": pipelines,
        "notEvaluated": skipped,
    }


def _deploy_schema(source: Source) -> dict[str, Any]:
    """The deploy loader's field lists (`stage_config.py`), which decide what lands in engine args."""
    mod = source.module("vllm_omni.config.stage_config")
    tree = ast.parse(source.files[STAGE_CONFIG])
    body = next(c.body for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "StageDeployConfig")
    annotated = [n for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    stage_fields = [n.target.id for n in annotated]
    # Literal defaults other than None: vLLM-Omni copies every set field into the engine args.
    defaults = {n.target.id: n.value.value for n in annotated
                if isinstance(n.value, ast.Constant) and n.value.value is not None}
    reserved = mod.assigns["_STAGE_RESERVED_KEYS"]
    if not (isinstance(reserved, ast.Call) and reserved.args):
        raise Unevaluable("_STAGE_RESERVED_KEYS is not frozenset({...})")
    return {
        "stageFields": stage_fields,
        "stageFieldDefaults": defaults,
        "stageReservedKeys": sorted(mod.eval(ast.List(elts=list(reserved.args[0].elts)))),
        "deepMergeKeys": sorted(mod.eval(ast.List(elts=list(mod.assigns["_DEEP_MERGE_KEYS"].args[0].elts)))),
        "pipelineWideEngineFields": mod.lookup("_PIPELINE_WIDE_ENGINE_FIELDS"),
    }


def data_path(version: str) -> Path:
    return DATA_DIR / f"pipelines-{version}.yaml"


def render(data: dict[str, Any]) -> str:
    header = (f"# vLLM-Omni {data['vllmOmniVersion']} pipeline topologies, generated by\n"
              f"# `python -m omnifleet_operator.vllm_omni.topology WHEEL`; do not edit.\n")
    return header + yaml.safe_dump(data, sort_keys=True, width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnifleet_operator.vllm_omni.topology", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="a vllm_omni wheel, or a directory it was unpacked into")
    p.add_argument("-o", "--output", type=Path, help="default: pipelines-<version>.yaml beside this module")
    args = p.parse_args(argv)
    data = extract(args.source)
    out = args.output or data_path(data["vllmOmniVersion"])
    out.write_text(render(data))
    print(f"{out}: {len(data['pipelines'])} pipelines, {len(data['notEvaluated'])} not evaluated", file=sys.stderr)
    for key, why in data["notEvaluated"].items():
        print(f"  {key}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
