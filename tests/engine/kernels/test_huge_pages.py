"""``on_huge_pages``: the same values, on huge pages (Linux's smaps says so); a small tensor stays as it is."""

from __future__ import annotations

import torch

from engine.kernels.huge_pages import HUGE_PAGE, on_huge_pages


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps), in bytes."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: start-end perms offset dev inode ...
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) << 10
    return 0


def test_a_weight_moves_onto_huge_pages_with_its_values():
    weight = torch.randn(3 * HUGE_PAGE // 4 + 5, dtype=torch.float32).reshape(-1, 1)  # 3 huge pages and a bit
    moved = on_huge_pages(weight)
    assert torch.equal(moved, weight) and moved.shape == weight.shape and moved.is_contiguous()
    assert moved.data_ptr() % HUGE_PAGE == 0
    # Huge pages where the kernel had them free (each page falls back to 4 KiB ones where compaction fails: the
    # machine's state decides how many), none before the advice: THP is madvise-only here.
    assert huge_bytes_at(moved.data_ptr()) >= HUGE_PAGE


def test_a_tensor_under_two_huge_pages_stays_as_it_is():
    small = torch.randn(HUGE_PAGE // 4)
    assert on_huge_pages(small) is small
