"""The kernel-instance compiler: instances.yaml -> one CUDA TU per FMHA instance, the dispatch
table, the CMake source list and a manifest.

  config     load and check instances.yaml (yamllines keeps the line numbers)
  schema     the axes, their values and each value's C++ spelling
  model      FwdTraits, MatrixPoint, Tile, Instance and its name
  catalog    expand the matrix, prune by rules, assign tiles
  dispatch   the runtime's matching rule (serves), the order of preference, the proof that
             every instance is chosen for some problem
  selection  the --filter grammar, presets, --targets, --shard
  explain    --explain: which instance a problem gets, and why
  render     the Jinja2 templates in templates/ and the manifest
  output     write-if-changed, stale-file removal
  cli        python -m generator
"""
