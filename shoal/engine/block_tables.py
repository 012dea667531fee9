"""The runner's block tables, kept across steps: one row of a preallocated tensor per request, changed
only by what a step changes (a request's first table, the blocks appended to it, its end).

A step's attention inputs are then gathered from it in a few tensor operations (slots, padded
tables for the rows of a step) instead of being rebuilt in Python from every request's table."""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, rows: int = 64, width: int = 64):
        self.table = torch.zeros(rows, width, dtype=torch.int64)  # unused entries hold block 0
        self.num_blocks: list[int] = [0] * rows
        self.row_of: dict[str, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    def put(self, request_id: str, block_ids: list[int]) -> None:
        """The request's whole table (a new request, or one the runner heard of again)."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self.row_of[request_id] = self._free.pop()
        self._fit(len(block_ids))
        self.table[row].zero_()
        self.num_blocks[row] = 0
        self._write(row, block_ids)

    def extend(self, request_id: str, block_ids: list[int]) -> None:
        row = self.row_of[request_id]
        self._fit(self.num_blocks[row] + len(block_ids))
        self._write(row, block_ids)

    def drop(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.table[row, : self.num_blocks[row]] = 0
            self.num_blocks[row] = 0
            self._free.append(row)

    def block_ids(self, request_id: str) -> list[int]:
        row = self.row_of[request_id]
        return self.table[row, : self.num_blocks[row]].tolist()

    def rows(self, request_ids: list[str]) -> torch.Tensor:
        row_of = self.row_of
        return torch.tensor([row_of[r] for r in request_ids], dtype=torch.int64)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """The K/V slot of each (row, position) pair."""
        return self.table[rows, positions // block_size] * block_size + positions % block_size

    def padded(self, rows: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
        """[len(rows), blocks covering num_tokens]: the rows' tables, padded with block 0."""
        return self.table[rows, : -(-num_tokens // block_size)]

    def _write(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        if block_ids:
            self.table[row, n : n + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = n + len(block_ids)

    def _fit(self, width: int) -> None:
        if width > self.table.shape[1]:
            grown = torch.zeros(self.table.shape[0], max(width, 2 * self.table.shape[1]), dtype=torch.int64)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        grown = torch.zeros(2 * old, self.table.shape[1], dtype=torch.int64)
        grown[:old] = self.table
        self.table = grown
        self.num_blocks += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1))
