"""The bin of each slot, run-length encoded: what a large epoch keeps of its packing while it
is scheduled (`batchplan.planning.bins.PackedBins.compress`).

Best fit decreasing places slots longest first, and the slots of one length mostly go into
the same bin several at a time: on lognormal lengths (median 300, cap 8,192) a run of slots
in one bin is 8.4 slots long on average, so a run (its bin, and its length as uint16: 6
bytes with int32 bins) costs 0.7 bytes per slot against 4 for the bin of each slot, and
encoding and decoding are one sequential pass each, where packing the histogram again to
get the bins back costs as much as packing it.

The slots are split into ``parts`` shares (`batchplan.kernels.split.share`), each encoded on
its own into arrays of its own (a run never crosses a share's end, nor holds more than
`MAX_RUN` slots): threads encode and decode the parts at once, and a part's runs are freed as
soon as it is decoded; decoding with the same ``parts`` gives the bins back exactly.
"""

from __future__ import annotations

from numba import njit

from batchplan.kernels.split import share

__all__ = ["MAX_RUN", "count_runs", "decode_runs", "encode_runs"]

# The longest run one uint16 length holds; a longer one is cut into runs of this length.
MAX_RUN = 65535


@njit(cache=True, nogil=True)
def count_runs(slot_bin, part, parts):
    """Runs in this part's share of ``slot_bin``."""
    low, high = share(slot_bin.shape[0], part, parts)
    runs = 0
    length = 0
    for slot in range(low, high):
        if length == 0 or length == MAX_RUN or slot_bin[slot] != slot_bin[slot - 1]:
            runs += 1
            length = 0
        length += 1
    return runs


@njit(cache=True, nogil=True)
def encode_runs(slot_bin, run_bin, run_length, part, parts):
    """This part's runs, written from the start of ``run_bin`` and ``run_length`` (its own
    arrays, `count_runs` long): each run's bin and its slots."""
    low, high = share(slot_bin.shape[0], part, parts)
    run = -1
    length = 0
    for slot in range(low, high):
        if length == 0 or length == MAX_RUN or slot_bin[slot] != slot_bin[slot - 1]:
            if length:
                run_length[run] = length
            run += 1
            run_bin[run] = slot_bin[slot]
            length = 0
        length += 1
    if length:
        run_length[run] = length


@njit(cache=True, nogil=True)
def decode_runs(run_bin, run_length, slot_bin, part, parts):
    """This part's share of ``slot_bin`` from its runs; returns the slots written: its share's
    size when the runs are its own, -1 (nothing written past the share) when they hold more."""
    slot, high = share(slot_bin.shape[0], part, parts)
    first = slot
    for run in range(run_bin.shape[0]):
        value = run_bin[run]
        if slot + run_length[run] > high:
            return -1
        for _ in range(run_length[run]):
            slot_bin[slot] = value
            slot += 1
    return slot - first
