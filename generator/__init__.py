"""The kernel-instance compiler: instances.yaml -> one CUDA TU per FMHA instance of each
operation (fwd, bwd, kvcache), the dispatch table (one array per operation), the CMake source
list and a manifest.

  config      load and check instances.yaml (yamllines keeps the line numbers)
  schema      the shared vocabulary: the axes, their values and each value's C++ spelling
  model       the traits of each operation (FwdTraits, BwdTraits), MatrixPoint, Tile, Instance
              and its name
  operations  what differs per operation: its traits class, kernels (header, config template,
              launcher, tile constraints, shared memory), TU template, C++ table; the place to
              add one
  catalog     per operation: expand the matrix, prune by rules, assign tiles
  catalog_cache
              the catalog and its checked presets, kept on disk between runs
  dispatch    the runtime's matching rule (serves), the order of preference, the proof that
              every instance is chosen for some problem of its operation
  selection   the --filter grammar, presets, --targets, --shard
  explain     --explain: which instance a problem gets, and why
  render      the Jinja2 templates in templates/ and the manifest
  output      write-if-changed, stale-file removal
  cli         python -m generator
"""
