"""Rendering a selection into the generated sources: one TU per instance (from its operation's
template), the dispatch table (one array per operation), the CMake source list and the
manifest, all from the same ordered list of instances.

The templates only loop and substitute; every C++ spelling is looked up here, from the schema
and the operations.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2

from .gaps import PipelineGap
from .model import ABSENT, Condition, Instance, Traits
from .operations import (OPERATIONS, PREFILL_MIN_PACKED_ROWS, PREFILL_PAGE_MULTIPLE, Operation,
                         operation_of)
from .schema import ARCH, PIPELINE, REGISTRY_TOKEN_ARRAYS, EnumValue
from .selection import Selection, Shard

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
MANIFEST = "manifest.json"


def tu_name(instance: Instance) -> str:
    """The instance's TU, relative to the output directory (also its `tu` in the manifest)."""
    return f"{instance.name}.cu"


def instance_record(instance: Instance) -> dict:
    """One instance as --json and manifest.json list it: tokens, not C++ spellings. Its op,
    then its operation's traits in their class's order."""
    traits, point, tile = instance.point.traits, instance.point, instance.tile
    return {
        "name": instance.name,
        "op": instance.op.token,
        **{axis: _token(getattr(traits, axis)) for axis in traits.axes()},
        "pipeline": point.pipeline.token,
        "arch": point.arch.token,
        "pad_seqlen": point.pad_seqlen,
        "pad_hdim": point.pad_hdim,
        **_tile_fields(tile),
        # The tile of calls that fill every SM, where the instance has one.
        **({"full_grid": _tile_fields(tile.full_grid)} if tile.full_grid else {}),
        "tu": tu_name(instance),
    }


def _token(value):
    return value.token if isinstance(value, EnumValue) else value


def json_text(data) -> str:
    return json.dumps(data, indent=2) + "\n"


def render(selection: Selection, source: str, shard: Shard | None = None) -> dict[str, str]:
    """Every generated file, by name relative to the output directory. `source` is the
    configuration's file name, for the do-not-edit banners.

    With a shard, only its TUs are rendered and listed in instances.cmake, while
    dispatch_table.cpp and the manifest still describe the whole selection: the objects that N
    shard jobs build then link against one and the same table."""
    env = _environment()
    built = shard.take(selection.instances) if shard else selection.instances
    files = {}
    for instance in built:
        op = operation_of(instance)
        files[tu_name(instance)] = env.get_template(op.template).render(
            source=source, **_instance_fields(op, instance))
    files["dispatch_table.cpp"] = env.get_template("dispatch_table.cpp.j2").render(
        source=source,
        # Every operation registry.h declares a table of, selected or not: an operation without
        # instances gets an empty one.
        operations=[_table(op, selection) for op in OPERATIONS.values()],
        targets=[arch.token for arch in selection.targets],
        # Every target the schema knows, best first for a device that runs several: a miss then
        # names the target that would build code for the device, compiled or not.
        known_targets=[{"token": a.token, "cc": a.cc, "exact": _cpp_bool(a.exact)}
                       for a in sorted(ARCH, key=lambda a: (-a.cc, not a.exact))],
        token_arrays=[{"name": name, "tokens": [value.token for value in
                                                 sorted(axis, key=lambda value: value.value)]}
                      for name, axis in REGISTRY_TOKEN_ARRAYS.items()],
        pipelines=PIPELINE.tokens,
        prefill={"min_packed_rows": PREFILL_MIN_PACKED_ROWS,
                 "page_multiple": PREFILL_PAGE_MULTIPLE},
    )
    built_targets = [arch for arch in selection.targets
                     if any(i.point.arch == arch for i in built)]
    cutlass_names = {tu_name(i) for i in built if _kernel(i).uses_cutlass}
    # The TUs that include CUTLASS compile for a minute, the others for seconds: listed first
    # (their target first, then they within it), ninja starts them first rather than leaving one
    # running alone at the end of a build (the default's chunked-prefill TU kept one core of two
    # idle for 40 s).
    def build_order(names):
        return sorted(names, key=lambda name: (name not in cutlass_names, name))
    targets = sorted(({"token": arch.token, "gencode": arch.gencode,
                       "sources": build_order(tu_name(i) for i in built if i.point.arch == arch)}
                      for arch in built_targets),
                     key=lambda target: not cutlass_names & set(target["sources"]))
    files["instances.cmake"] = env.get_template("instances.cmake.j2").render(
        source=source,
        shard=str(shard) if shard else "",
        targets=targets,
        cutlass_sources=sorted(cutlass_names),
    )
    files[MANIFEST] = json_text({
        "targets": [arch.token for arch in selection.targets],
        # null, or which part of the selection's TUs this directory holds.
        "shard": {"index": shard.index, "count": shard.count,
                  "tus": [tu_name(i) for i in built]} if shard else None,
        "instances": [instance_record(i) for i in selection.instances],
    })
    return files


def render_loadable(selection: Selection, source: str) -> dict[str, str]:
    """The files of a shared object of the selection's instances that a build of libfmha loads
    at run time (fmha::load_instances; compile on demand): one TU per instance, as render()
    writes them, and loadable_table.cpp, their rows as the dispatch table would hold them and
    the function that hands them over. The loading library orders them among its own."""
    env = _environment()
    files = {tu_name(instance): env.get_template(operation_of(instance).template).render(
        source=source, **_instance_fields(operation_of(instance), instance))
        for instance in selection.instances}
    files["loadable_table.cpp"] = env.get_template("loadable_table.cpp.j2").render(
        source=source, operations=[_table(op, selection) for op in OPERATIONS.values()])
    files[MANIFEST] = json_text({
        "targets": [arch.token for arch in selection.targets], "shard": None, "loadable": True,
        "instances": [instance_record(i) for i in selection.instances],
    })
    return files


def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True, autoescape=False)


def manifest_sources(out_dir: Path) -> set[str]:
    """The TUs the previous run wrote into `out_dir`, from its manifest (a shard's own, when it
    was sharded): the generated files this run may delete. Without a readable manifest the
    generator owns nothing there."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
        if manifest.get("shard") is not None:
            return set(manifest["shard"]["tus"])
        return {record["tu"] for record in manifest["instances"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _cpp_bool(value: bool) -> str:
    return "true" if value else "false"


def _cpp_string(text: str) -> str:
    """A C++ string literal of `text`: quotes, backslashes and question marks (no trigraph)
    escaped, control characters as octal escapes (at most three digits, so that a following
    digit is not swallowed)."""
    escaped = "".join(f"\\{char}" if char in '"\\?'
                      else f"\\{ord(char):03o}" if ord(char) < 0x20 or ord(char) == 0x7f
                      else char for char in text)
    return f'"{escaped}"'


def _cpp_value(value) -> str:
    if isinstance(value, bool):
        return _cpp_bool(value)
    return value.cpp if isinstance(value, EnumValue) else str(value)


def _cpp_sort_key(value):
    return value.value if isinstance(value, EnumValue) else value


def _cpp_test(condition: Condition) -> str:
    """The condition as a C++ expression on the traits `t` (`const FwdTraits& t`, ...)."""
    def equals(value) -> str:
        if condition.axis == "hdim":
            return f"(t.hdim_q == {value[0]} && t.hdim_v == {value[1]})"
        return f"t.{condition.axis} == {_cpp_value(value)}"
    any_of = " || ".join(equals(v) for v in sorted(condition.values, key=_cpp_sort_key))
    return f"!({any_of})" if condition.negated else f"({any_of})"


def _gap_row(gap: PipelineGap) -> dict:
    return {
        "pipeline": gap.pipeline.token,
        "arch": gap.arch.token,
        "traits": ",".join(condition.axis for condition in gap.conditions),
        "reason": _cpp_string(gap.reason),
        "test": " && ".join(_cpp_test(condition) for condition in gap.conditions),
    }


def _kernel(instance: Instance):
    return operation_of(instance).kernel(instance.point.pipeline)


def _instance_fields(op: Operation, instance: Instance) -> dict:
    """What an instance TU's template substitutes: its kernel's C++ names, then the config's
    parameters."""
    traits, point, tile = instance.point.traits, instance.point, instance.tile
    kernel = op.kernel(point.pipeline)
    return {
        "name": instance.name,
        "header": kernel.header,
        "config_template": kernel.config_template,
        "launcher": kernel.launcher,
        "workspace": kernel.workspace,
        "element": traits.dtype.element,
        # The cache's element type (kvcache): the dtype's, or what kv_dtype names.
        "kv_element": None if (kv := traits.value("kv_dtype")) is ABSENT
        else kv.element_for(traits.dtype),
        "hdim_q": traits.hdim_q,
        "hdim_v": traits.hdim_v,
        "tile": _tile_fields(tile),
        # The tile of calls that fill every SM (Kernel.full_grid_tile), or None.
        "full_grid": _tile_fields(tile.full_grid),
        **_trait_fields(traits),
        "pad_seqlen": _cpp_bool(point.pad_seqlen),
        "pad_hdim": _cpp_bool(point.pad_hdim),
        "smem_limit": point.arch.smem_limit,
        "extended_wgmma_shapes": any(
            kernel.extended_wgmma_shapes(t, (traits.hdim_q, traits.hdim_v))
            for t in (tile, tile.full_grid) if t is not None),
    }


def _tile_fields(tile) -> dict | None:
    """A tile's shape (None for no tile: an instance without a full-grid one)."""
    if tile is None:
        return None
    return {"block_m": tile.block_m, "block_n": tile.block_n, "warps": tile.warps,
            "stages": tile.stages}


def _table(op: Operation, selection: Selection) -> dict:
    """One operation's part of the dispatch table: its launch (and workspace) declarations,
    its rows in dispatch order and its pipeline gaps, with registry.h's names."""
    instances = [i for i in selection.instances if i.op == op.kind]
    return {
        "op": op.token,
        "table": op.table, "count": op.count, "entry": op.entry,
        "gaps": op.gaps, "gap_count": op.gap_count, "gap_type": op.gap_type,
        "padded_hdim_step": op.padded_hdim_step, "padded_hdim_step_name": op.padded_hdim_step_name,
        "traits": op.traits_cpp,
        # The arrays behind registry.h's pointers: kFwdRows, kFwdGapRows, kBwdRows, ...
        "rows_array": f"k{op.registry}Rows", "gap_rows_array": f"k{op.registry}GapRows",
        "declarations": [export.declaration(i.name) for i in instances for export in op.exports],
        "rows": [_dispatch_row(op, i) for i in instances],
        "gap_rows": [_gap_row(gap) for gap in selection.gaps if gap.op == op.kind],
        "matrix_head_dims": op.matrix_head_dims,
        "matrix_head_dim_count": op.matrix_head_dim_count,
        "head_dim_rows": selection.head_dims.get(op.kind, ()),
        "head_dim_rows_array": f"k{op.registry}MatrixHeadDimRows",
    }


def _dispatch_row(op: Operation, instance: Instance) -> dict:
    traits, point, tile = instance.point.traits, instance.point, instance.tile
    values = {"dtype": traits.dtype.cpp, "hdim_q": traits.hdim_q, "hdim_v": traits.hdim_v,
              **_trait_fields(traits)}
    return {
        "name": instance.name,
        # The traits' initializer, laid out on the operation's row_lines.
        "traits": ",\n      ".join(", ".join(f"/*{axis}=*/{values[axis]}" for axis in line)
                                   for line in op.row_lines),
        "pipeline": point.pipeline.token,
        "arch": point.arch.token,
        "arch_cc": point.arch.cc,
        "arch_exact": _cpp_bool(point.arch.exact),
        "block_m": tile.block_m,
        "block_n": tile.block_n,
        "pad_seqlen": _cpp_bool(point.pad_seqlen),
        "pad_hdim": _cpp_bool(point.pad_hdim),
        # The rows of an operation with a prefill kernel (kvcache) say whether they are its,
        # and where its kernels may take a full-grid tile, that tile's block_n (0: none).
        "prefill": (f" /*prefill=*/{_cpp_bool(op.kernel(point.pipeline).prefill)},"
                    if any(kernel.prefill for kernel in op.kernels) else ""),
        "full_grid": (f" /*full_grid_block_n=*/{tile.full_grid.block_n if tile.full_grid else 0},"
                      if any(kernel.full_grid_tile for kernel in op.kernels) else ""),
        "functions": ", ".join(export.pointer(instance.name) for export in op.exports),
    }


def _trait_fields(traits: Traits) -> dict:
    """The C++ spellings of the traits after the head dims, as the templates pass them."""
    return {axis: _cpp_value(getattr(traits, axis)) for axis in traits.axes()
            if axis not in ("dtype", "hdim_q", "hdim_v")}
