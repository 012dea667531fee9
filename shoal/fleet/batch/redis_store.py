"""The batch lane's state in the store several gateways share (`--store`), so that any gateway
takes files and batches and answers for them, and the fleet's leader runs them: after its death
the next leader runs on where it stopped. The same methods as store.BatchStore, blocking (the
runner calls them on a thread).

Exactly one result per line, whatever dies when: a line is claimed by moving it from its
batch's pending set to its running set, and a result is kept only by a runner that moves the line
out of the running set, in the same script that writes the result (at most once per line) and
counts it. A new leader puts the running lines back to pending. An old runner that finishes one
of them later is dropped while the line waits to run again; once it runs again, whichever run
finishes first is kept and the other is dropped."""

from __future__ import annotations

import json
import time

from shoal.fleet.admission.store import connect
from shoal.fleet.batch.store import (
    ACTIVE,
    TIMES,
    Line,
    final_status,
    line_models,
    new_batch_row,
    new_file_row,
    render_batch,
    render_file,
    result_line,
)

FINISH = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
redis.call('HINCRBY', KEYS[3], 'input_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'output_tokens', ARGV[5])
return 1
"""
CLAIM = """
local got = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
local out = {}
for i = 1, #got, 2 do
  redis.call('SADD', KEYS[2], got[i])
  table.insert(out, got[i])
  table.insert(out, redis.call('HINCRBY', KEYS[3], got[i], 1))
end
return out
"""
REQUEUE = """
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
  return 1
end
return 0
"""
FAIL = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[3], 'failed', 1)
  return 1
end
return 0
"""
# The batch's status moves only from the one its caller read: two writers cannot both move it.
MOVE = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
FILE_FIELDS = ("id", "tenant", "purpose", "filename", "bytes", "created_at", "seq")  # all but its content
INTS = ("total", "completed", "failed", "input_tokens", "output_tokens", "bytes", "seq")


def _model_key(model: str | None) -> str:
    return "\x00" if model is None else model


class RedisBatchStore:
    def __init__(self, url: str, prefix: str, timeout_s: float):
        """Commands fail after `timeout_s` (the caller's StoreCalls says so once)."""
        self.r = connect(url, timeout_s, blocking=True)
        self.p = prefix  # e.g. "shoal:batch:"
        self._finish, self._claim, self._requeue, self._fail, self._move = (
            self.r.register_script(s) for s in (FINISH, CLAIM, REQUEUE, FAIL, MOVE)
        )

    def close(self) -> None:
        self.r.close()

    def _k(self, *parts: str) -> str:
        return self.p + ":".join(parts)

    def _row(self, key: str, fields: tuple[str, ...] | None = None) -> dict | None:
        """The record at `key` (only `fields`, when given: a file's, without its content)."""
        if fields is None:
            raw = {k.decode(): v for k, v in self.r.hgetall(key).items()}
        else:
            raw = {f: v for f, v in zip(fields, self.r.hmget(key, fields), strict=True) if v is not None}
        if not raw:
            return None
        row = {k: v.decode() for k, v in raw.items()}
        out: dict = dict.fromkeys(TIMES)
        out.update(metadata=None, errors=None, models=None, output_file_id=None, error_file_id=None)
        for k, v in row.items():
            out[k] = int(v) if k in INTS else float(v) if k in TIMES else v
        return out

    def _seq(self) -> int:
        return int(self.r.incr(self._k("seq")))

    # --- files ---------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        row = {**new_file_row(tenant, purpose, filename, content), "seq": self._seq()}
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self._k("file", row["id"]), mapping={**row, "content": content})
        pipe.zadd(self._k("files", tenant), {row["id"]: row["seq"]})
        pipe.execute()
        return render_file(row)

    def _owned(self, kind: str, tenant: str, record_id: str) -> dict | None:
        """The tenant's file or batch of that id (None: none, or another tenant's)."""
        row = self._row(self._k(kind, record_id), FILE_FIELDS if kind == "file" else None)
        return row if row is not None and row["tenant"] == tenant else None

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        row = self._owned("file", tenant, file_id)
        return render_file(row) if row else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        owner, content = self.r.hmget(self._k("file", file_id), ["tenant", "content"])
        return content if owner is not None and owner.decode() == tenant else None

    def _page(self, index: str, after: str | None, newest_first: bool) -> list[str]:
        ids = [i.decode() for i in (self.r.zrevrange if newest_first else self.r.zrange)(index, 0, -1)]
        if after:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        return ids

    def list_files(
        self, tenant: str, purpose: str | None, limit: int, after: str | None, newest_first: bool = True
    ) -> tuple[list[dict], bool]:
        rows = []
        for file_id in self._page(self._k("files", tenant), after, newest_first):
            row = self._row(self._k("file", file_id), FILE_FIELDS)
            if row is not None and (not purpose or row["purpose"] == purpose):
                rows.append(row)
                if len(rows) > limit:
                    break
        return [render_file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> bool:
        if self._owned("file", tenant, file_id) is None:
            return False
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self._k("file", file_id))
        pipe.zrem(self._k("files", tenant), file_id)
        return bool(pipe.execute()[0])

    # --- batches -------------------------------------------------------------------------

    def add_batch(self, tenant, endpoint, input_file_id, window, window_s, metadata, lines, errors) -> dict:
        made = new_batch_row(tenant, endpoint, input_file_id, window, window_s, metadata, lines, errors)
        row = {
            "total": 0,
            "completed": 0,
            "failed": 0,
            "input_tokens": 0,
            "output_tokens": 0,
            "seq": self._seq(),
        }
        row.update((k, v) for k, v in made.items() if v is not None)
        bid = row["id"]
        pipe = self.r.pipeline(transaction=True)
        if not errors:
            models = line_models(lines)
            for start in range(0, len(lines), 1000):
                chunk = list(enumerate(lines[start : start + 1000], start))
                pipe.hset(self._k("lines", bid), mapping={i: json.dumps(line) for i, line in chunk})
                for model in models:
                    mine = {i: i for i, (_, m, _) in chunk if m == model}
                    if mine:
                        pipe.zadd(self._k("pending", bid, _model_key(model)), mine)
            pipe.zadd(self._k("active"), {bid: row["seq"]})
        pipe.hset(self._k("batch", bid), mapping=row)
        pipe.zadd(self._k("batches", tenant), {bid: row["seq"]})
        pipe.execute()
        return render_batch(self._row(self._k("batch", bid)))

    def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        row = self._owned("batch", tenant, batch_id)
        return render_batch(row) if row else None

    def list_batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        ids = self._page(self._k("batches", tenant), after, True)[: limit + 1]
        rows = [r for r in (self._row(self._k("batch", i)) for i in ids) if r is not None]
        return [render_batch(r) for r in rows[:limit]], len(ids) > limit

    def cancel(self, tenant: str, batch_id: str) -> dict | None:
        row = self._owned("batch", tenant, batch_id)
        if row is None:
            return None
        key = self._k("batch", batch_id)
        if row["status"] == "in_progress":
            self._move(keys=[key], args=["in_progress", "status", "cancelling", "cancelling_at", time.time()])
            self._fail_pending(row, "batch_cancelled", "the batch was cancelled")
        return render_batch(self._row(key))

    # --- the runner's side ---------------------------------------------------------------

    def _models(self, row: dict) -> list[str | None]:
        return json.loads(row["models"] or "[]")

    def recover(self) -> int:
        """The running lines of every active batch back to pending (none has a result)."""
        moved = 0
        for bid in self.active():
            running = [int(x) for x in self.r.smembers(self._k("running", bid))]
            if not running:
                continue
            records = self.r.hmget(self._k("lines", bid), running)
            for line_no, record in zip(running, records, strict=True):
                model = json.loads(record)[1] if record else None
                keys = [
                    self._k("running", bid),
                    self._k("pending", bid, _model_key(model)),
                    self._k("results", bid),
                ]
                moved += self._requeue(keys=keys, args=[line_no])
        return moved

    def active(self) -> dict[str, list[str | None]]:
        out = {}
        for bid in (i.decode() for i in self.r.zrange(self._k("active"), 0, -1)):
            row = self._row(self._k("batch", bid))
            if row is not None and row["status"] in ACTIVE:
                out[bid] = self._models(row)
        return out

    def claim(self, n: int, model: str | None = None, by_model: bool = False) -> list[Line]:
        out: list[Line] = []
        now = time.time()
        for bid, models in self.active().items():
            row = self._row(self._k("batch", bid))
            if row["status"] != "in_progress" or row["expired_at"] is not None or row["expires_at"] <= now:
                continue
            for m in [model] if by_model else models:
                if len(out) >= n or m not in models:
                    continue
                keys = [
                    self._k("pending", bid, _model_key(m)),
                    self._k("running", bid),
                    self._k("attempts", bid),
                ]
                got = self._claim(keys=keys, args=[n - len(out)])
                pairs = [(int(got[i]), int(got[i + 1])) for i in range(0, len(got), 2)]
                records = self.r.hmget(self._k("lines", bid), [ln for ln, _ in pairs]) if pairs else []
                for (ln, attempts), record in zip(pairs, records, strict=True):
                    custom_id, lm, body = json.loads(record)
                    out.append(Line(bid, ln, custom_id, lm, body, attempts, row["endpoint"], row["tenant"]))
            if len(out) >= n:
                break
        return out

    def finish(self, line: Line, ok: bool, result: str, usage: tuple[int, int] = (0, 0)) -> bool:
        bid = line.batch_id
        keys = [self._k("running", bid), self._k("results", bid), self._k("batch", bid)]
        value = ("d" if ok else "f") + result
        args = [line.line_no, value, "completed" if ok else "failed", usage[0], usage[1]]
        return bool(self._finish(keys=keys, args=args))

    def requeue(self, line: Line) -> None:
        bid = line.batch_id
        keys = [
            self._k("running", bid),
            self._k("pending", bid, _model_key(line.model)),
            self._k("results", bid),
        ]
        self._requeue(keys=keys, args=[line.line_no])

    def _fail_pending(self, row: dict, code: str, message: str) -> int:
        bid, error, failed = row["id"], {"code": code, "message": message}, 0
        for model in self._models(row):
            pending_key = self._k("pending", bid, _model_key(model))
            waiting = [int(x) for x in self.r.zrange(pending_key, 0, -1)]
            if not waiting:
                continue
            records = self.r.hmget(self._k("lines", bid), waiting)
            keys = [pending_key, self._k("results", bid), self._k("batch", bid)]
            for ln, record in zip(waiting, records, strict=True):
                value = "f" + result_line(json.loads(record)[0], error=error)
                failed += self._fail(keys=keys, args=[ln, value])
        return failed

    def sweep(self, now: float | None = None) -> dict[str, list[str | None]]:
        now = time.time() if now is None else now
        for bid in self.active():
            key = self._k("batch", bid)
            b = self._row(key)
            if b["status"] == "cancelling":
                self._fail_pending(b, "batch_cancelled", "the batch was cancelled")
            elif b["status"] == "in_progress" and b["expires_at"] <= now:
                if b["expired_at"] is None:
                    self.r.hset(key, "expired_at", now)
                message = "the batch's completion window ended before this request ran"
                self._fail_pending(b, "batch_expired", message)
            b = self._row(key)
            done = b["completed"] + b["failed"] >= b["total"]
            if done and b["status"] == "in_progress" and b["expired_at"] is None:
                self._move(keys=[key], args=["in_progress", "status", "finalizing", "finalizing_at", now])
            if done:
                self._finalize(bid, now)
        return self.active()

    def _finalize(self, batch_id: str, now: float) -> None:
        key = self._k("batch", batch_id)
        b = self._row(key)
        if b["status"] not in ACTIVE:
            return
        results = sorted(
            (int(k), v.decode()) for k, v in self.r.hgetall(self._k("results", batch_id)).items()
        )
        ids = {}
        for mark, kind in (("d", "output"), ("f", "error")):
            lines = [v[1:] for _, v in results if v[0] == mark]
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                f = self.add_file(b["tenant"], "batch_output", f"{batch_id}_{kind}.jsonl", content)
                ids[kind] = f["id"]
        status, stamp = final_status(b)
        fields = ["status", status, stamp, b[stamp] or now]
        fields += [f for kind in ("output", "error") if kind in ids for f in (f"{kind}_file_id", ids[kind])]
        if not self._move(keys=[key], args=[b["status"], *fields]):
            for file_id in ids.values():  # another runner finalized it meanwhile
                self.delete_file(b["tenant"], file_id)
            return
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(self._k("active"), batch_id)
        pipe.delete(
            *(self._k(part, batch_id) for part in ("lines", "running", "attempts", "results")),
            *(self._k("pending", batch_id, _model_key(m)) for m in self._models(b)),
        )
        pipe.execute()
