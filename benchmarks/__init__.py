"""fastdcp benchmark suite: fastdcp vs stock torch.distributed.checkpoint storage.

Run `python -m benchmarks --quick` (a few minutes) or `python -m benchmarks` (full, 2 GiB);
`python -m benchmarks --help` lists the options. Modules:

* config     command line -> BenchConfig
* systems    the compared storage layers (stock, stock_best, fastdcp)
* state      synthetic LLM-like state dicts, load targets, bit-exact verification
* limits     raw storage / memory-copy / pinned-copy bandwidth probes
* pagecache  cold/warm page cache control, filesystem facts
* machine    machine facts
* scenarios  single-process scenarios (save, load, small, async, gpu_*, --checkpoint)
* reshard    multi-process DTensor resharding scenario (gloo)
* results    result records, medians, ratios, fractions of the limits
* report     terminal table, JSON, plot
* runner     orchestration and exit codes
"""


def main(argv=None) -> int:
    from .runner import main as _main

    return _main(argv)
