"""fastdcp benchmark suite: fastdcp vs stock torch.distributed.checkpoint storage and peers.

Run `python -m fastdcp.bench --quick` (a few minutes) or `python -m fastdcp.bench` (full, 2 GiB);
`python -m fastdcp.bench --help` lists the options. Modules:

* config     command line -> BenchConfig
* systems    the compared systems (stock, stock_best, fastdcp, fastdcp_planners)
* peers      other checkpointing methods in the save/load loops, each optional (torch_save,
             safetensors, torchsnapshot, nvrx_async = nvidia-resiliency-ext as Megatron drives it)
* floor      DCP's own cost without storage: no-I/O StorageWriter/StorageReader
* state      synthetic LLM-like state dicts, load targets, bit-exact verification
* limits     raw storage / memory-copy / pinned-copy bandwidth probes
* pagecache  cold/warm page cache control, filesystem facts
* machine    machine facts
* scenarios  single-process scenarios (save, load, small + DCP floor, async + bare copy with one
             writer reused or a new writer per save (async_new_writer), gpu_save, gpu_load,
             gpu_async, --checkpoint)
* training_loop  train_loop: a synthetic training loop (model + AdamW) with an async_save every
             k steps: slowdown vs the same loop without checkpoints, blocked/staged/durable
             times per checkpoint, peak host memory (stock_default, stock_zoc, fastdcp_blocking,
             fastdcp_overlap, fastdcp_overlap_budget)
* reshard    multi-process DTensor resharding scenario (gloo)
* results    result records, medians, ratios, fractions of the limits
* report     terminal table, JSON, plot
* box_copy   the batched box copy alone (GPU kernel or CPU engine) vs copy_ per piece
* acceptance python -m fastdcp.bench gpu-acceptance: the GPU acceptance command (see docs/gpu.md)
* runner     orchestration and exit codes
"""


def main(argv=None) -> int:
    from .runner import main as _main

    return _main(argv)
