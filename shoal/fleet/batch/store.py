"""The batch lane's durable state: uploaded files, batches and their lines, in one SQLite file.

WAL with synchronous=NORMAL: a commit survives a kill -9 of the gateway (a power cut may lose the
last few). A line's result is written in the same transaction as its state change and its batch's
counters, so after a crash a line is either done, with exactly one result, or not, and runs again
(`recover` puts the lines that were running back to pending).

One connection guarded by a lock; methods block, so the event loop calls them via asyncio.to_thread.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass

ACTIVE = ("in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS files_tenant ON files(tenant);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, metadata TEXT, errors TEXT, models TEXT,
    output_file_id TEXT, error_file_id TEXT,
    created_at REAL NOT NULL, in_progress_at REAL, expires_at REAL, finalizing_at REAL,
    completed_at REAL, failed_at REAL, expired_at REAL, cancelling_at REAL, cancelled_at REAL,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_tenant ON batches(tenant);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, model TEXT,
    body TEXT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, result TEXT,
    PRIMARY KEY (batch_id, line_no)
);
CREATE INDEX IF NOT EXISTS lines_open ON lines(batch_id, state, line_no);
"""

TIMES = (
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


@dataclass
class Line:
    """A claimed line, with what running it needs from its batch."""

    batch_id: str
    line_no: int
    custom_id: str
    model: str | None
    body: str
    attempts: int
    endpoint: str
    tenant: str


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def result_line(
    custom_id: str, status: int | None = None, body: dict | None = None, error: dict | None = None
) -> str:
    """One line of an output or error file, in OpenAI's format."""
    response = None
    if status is not None:
        response = {"status_code": status, "request_id": new_id("req_"), "body": body}
    return json.dumps(
        {"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error},
        ensure_ascii=False,
    )


def new_file_row(tenant: str, purpose: str, filename: str, content: bytes) -> dict:
    """A new file's record, without its content."""
    return {
        "id": new_id("file-"),
        "tenant": tenant,
        "purpose": purpose,
        "filename": filename,
        "bytes": len(content),
        "created_at": int(time.time()),
    }


def line_models(lines: list[tuple[str, str | None, str]]) -> list[str | None]:
    """The models a batch's lines name, in a fixed order (None, the default, last)."""
    return sorted({m for _, m, _ in lines}, key=lambda m: (m is None, m or ""))


def new_batch_row(
    tenant: str,
    endpoint: str,
    input_file_id: str,
    window: str,
    window_s: float,
    metadata: dict | None,
    lines: list[tuple[str, str | None, str]],
    errors: list[dict],
) -> dict:
    """A new batch's record: in progress, or failed when its input had `errors`."""
    now = time.time()
    row = {
        "id": new_id("batch_"),
        "tenant": tenant,
        "endpoint": endpoint,
        "input_file_id": input_file_id,
        "completion_window": window,
        "metadata": json.dumps(metadata) if metadata is not None else None,
        "created_at": now,
    }
    if errors:
        row.update(status="failed", failed_at=now, errors=json.dumps({"object": "list", "data": errors}))
    else:
        row.update(
            status="in_progress",
            in_progress_at=now,
            expires_at=now + window_s,
            total=len(lines),
            models=json.dumps(line_models(lines)),
        )
    return row


def final_status(row) -> tuple[str, str]:
    """How a batch with no line left to run ends, and the time field that says when."""
    if row["status"] == "cancelling":
        return "cancelled", "cancelled_at"
    if row["expired_at"] is not None:
        return "expired", "expired_at"
    return "completed", "completed_at"


def render_file(row) -> dict:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": int(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
    }


def render_batch(row) -> dict:
    """OpenAI's Batch object."""
    out = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
    }
    out.update({k: None if row[k] is None else int(row[k]) for k in TIMES})
    out["request_counts"] = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    out["usage"] = {
        "input_tokens": row["input_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": row["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": row["input_tokens"] + row["output_tokens"],
    }
    return out


class BatchStore:
    def __init__(self, path: str):
        self._lock = threading.Lock()
        # isolation_level=None: transactions are only the explicit BEGIN IMMEDIATE ones below.
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _all(self, sql: str, args=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # --- files ---------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        with self._tx() as db:
            return render_file(self._insert_file(db, tenant, purpose, filename, content))

    @staticmethod
    def _insert_file(db, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        row = new_file_row(tenant, purpose, filename, content)
        db.execute(
            "INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, content) "
            "VALUES (:id, :tenant, :purpose, :filename, :bytes, :created_at, :content)",
            {**row, "content": content},
        )
        return row

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        rows = self._all(
            "SELECT id, purpose, filename, bytes, created_at FROM files WHERE id = ? AND tenant = ?",
            (file_id, tenant),
        )
        return render_file(rows[0]) if rows else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        rows = self._all("SELECT content FROM files WHERE id = ? AND tenant = ?", (file_id, tenant))
        return bytes(rows[0]["content"]) if rows else None

    def list_files(
        self, tenant: str, purpose: str | None, limit: int, after: str | None, newest_first: bool = True
    ) -> tuple[list[dict], bool]:
        """A page of the tenant's files, and whether more follow."""
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        sql, args = "SELECT id, purpose, filename, bytes, created_at FROM files WHERE tenant = ?", [tenant]
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            sql += f" AND rowid {cmp} (SELECT rowid FROM files WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        rows = self._all(f"{sql} ORDER BY rowid {order} LIMIT ?", [*args, limit + 1])
        return [render_file(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._tx() as db:
            return db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount > 0

    # --- batches -------------------------------------------------------------------------

    def add_batch(
        self,
        tenant: str,
        endpoint: str,
        input_file_id: str,
        window: str,
        window_s: float,
        metadata: dict | None,
        lines: list[tuple[str, str | None, str]],
        errors: list[dict],
    ) -> dict:
        """A batch of (custom_id, model, body) lines, in progress; or failed, when `errors`."""
        row = new_batch_row(tenant, endpoint, input_file_id, window, window_s, metadata, lines, errors)
        cols = ", ".join(row)
        with self._tx() as db:
            db.execute(f"INSERT INTO batches ({cols}) VALUES ({', '.join(':' + c for c in row)})", row)
            db.executemany(
                "INSERT INTO lines (batch_id, line_no, custom_id, model, body, state) "
                "VALUES (?, ?, ?, ?, ?, 'pending')",
                ((row["id"], i, cid, model, body) for i, (cid, model, body) in enumerate(lines)),
            )
            return render_batch(db.execute("SELECT * FROM batches WHERE id = ?", (row["id"],)).fetchone())

    def get_batch(self, tenant: str, batch_id: str) -> dict | None:
        rows = self._all("SELECT * FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant))
        return render_batch(rows[0]) if rows else None

    def list_batches(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """A page of the tenant's batches, newest first, and whether more follow."""
        sql, args = "SELECT * FROM batches WHERE tenant = ?", [tenant]
        if after:
            sql += " AND rowid < (SELECT rowid FROM batches WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        rows = self._all(f"{sql} ORDER BY rowid DESC LIMIT ?", [*args, limit + 1])
        return [render_batch(r) for r in rows[:limit]], len(rows) > limit

    def cancel(self, tenant: str, batch_id: str) -> dict | None:
        """Cancelling: its pending lines fail now, its running ones finish; None: no such batch.
        A batch already done is returned unchanged."""
        with self._tx() as db:
            row = db.execute(
                "SELECT status FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
            ).fetchone()
            if row is None:
                return None
            if row["status"] == "in_progress":
                db.execute(
                    "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ?",
                    (time.time(), batch_id),
                )
                self._fail_pending(db, batch_id, "batch_cancelled", "the batch was cancelled")
            return render_batch(db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())

    # --- the runner's side ---------------------------------------------------------------

    def recover(self) -> int:
        """After a crash or stop: lines that were running run again (none of them has a result)."""
        with self._tx() as db:
            return db.execute("UPDATE lines SET state = 'pending' WHERE state = 'running'").rowcount

    def active(self) -> dict[str, list[str | None]]:
        """Batches not yet done, oldest first, with the models their lines name."""
        rows = self._all(
            f"SELECT id, models FROM batches WHERE status IN ({', '.join('?' * len(ACTIVE))}) ORDER BY rowid",
            ACTIVE,
        )
        return {r["id"]: json.loads(r["models"] or "[]") for r in rows}

    def claim(self, n: int, model: str | None = None, by_model: bool = False) -> list[Line]:
        """Up to `n` pending lines (of `model`, when `by_model`), oldest batch first, now running."""
        sql = (
            "SELECT l.batch_id, l.line_no, l.custom_id, l.model, l.body, l.attempts, b.endpoint, b.tenant "
            "FROM batches b JOIN lines l ON l.batch_id = b.id WHERE b.status = 'in_progress' "
            "AND b.expired_at IS NULL AND b.expires_at > ? AND l.state = 'pending'"
        )
        args: list = [time.time()]
        if by_model:
            sql += " AND l.model IS ?"
            args.append(model)
        with self._tx() as db:
            rows = db.execute(f"{sql} ORDER BY b.rowid, l.line_no LIMIT ?", [*args, n]).fetchall()
            db.executemany(
                "UPDATE lines SET state = 'running', attempts = attempts + 1 "
                "WHERE batch_id = ? AND line_no = ?",
                ((r["batch_id"], r["line_no"]) for r in rows),
            )
        return [Line(**{**dict(r), "attempts": r["attempts"] + 1}) for r in rows]

    def finish(self, line: Line, ok: bool, result: str, usage: tuple[int, int] = (0, 0)) -> bool:
        """Records a running line's one result; False if it was not running (it has one already)."""
        with self._tx() as db:
            changed = db.execute(
                "UPDATE lines SET state = ?, result = ? "
                "WHERE batch_id = ? AND line_no = ? AND state = 'running'",
                ("done" if ok else "failed", result, line.batch_id, line.line_no),
            ).rowcount
            if changed:
                count = "completed" if ok else "failed"
                db.execute(
                    f"UPDATE batches SET {count} = {count} + 1, "
                    "input_tokens = input_tokens + ?, output_tokens = output_tokens + ? WHERE id = ?",
                    (usage[0], usage[1], line.batch_id),
                )
        return bool(changed)

    def requeue(self, line: Line) -> None:
        """A running line back to pending, to be tried again."""
        with self._tx() as db:
            db.execute(
                "UPDATE lines SET state = 'pending' WHERE batch_id = ? AND line_no = ? AND state = 'running'",
                (line.batch_id, line.line_no),
            )

    @staticmethod
    def _fail_pending(db, batch_id: str, code: str, message: str) -> int:
        rows = db.execute(
            "SELECT line_no, custom_id FROM lines WHERE batch_id = ? AND state = 'pending'", (batch_id,)
        ).fetchall()
        if not rows:
            return 0
        error = {"code": code, "message": message}
        db.executemany(
            "UPDATE lines SET state = 'failed', result = ? WHERE batch_id = ? AND line_no = ?",
            ((result_line(r["custom_id"], error=error), batch_id, r["line_no"]) for r in rows),
        )
        db.execute("UPDATE batches SET failed = failed + ? WHERE id = ?", (len(rows), batch_id))
        return len(rows)

    def sweep(self, now: float | None = None) -> dict[str, list[str | None]]:
        """Expires batches past their window, fails the pending lines of cancelling ones, finalizes
        those with no line left to run; returns the batches still active (see `active`)."""
        now = time.time() if now is None else now
        for batch_id in self.active():
            with self._tx() as db:
                b = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
                if b["status"] == "cancelling":
                    self._fail_pending(db, batch_id, "batch_cancelled", "the batch was cancelled")
                elif b["status"] == "in_progress" and b["expires_at"] <= now:
                    if b["expired_at"] is None:
                        db.execute("UPDATE batches SET expired_at = ? WHERE id = ?", (now, batch_id))
                    self._fail_pending(
                        db,
                        batch_id,
                        "batch_expired",
                        "the batch's completion window ended before this request ran",
                    )
                b = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
                done = b["completed"] + b["failed"] >= b["total"]
                if done and b["status"] == "in_progress" and b["expired_at"] is None:
                    db.execute(
                        "UPDATE batches SET status = 'finalizing', finalizing_at = ? WHERE id = ?",
                        (now, batch_id),
                    )
            if done:
                self._finalize(batch_id, now)
        return self.active()

    def _finalize(self, batch_id: str, now: float) -> None:
        """Writes the output and error files and ends the batch, in one transaction; its lines go."""
        with self._tx() as db:
            b = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if b["status"] not in ACTIVE:
                return
            ids = {}
            for state, kind in (("done", "output"), ("failed", "error")):
                results = [
                    r["result"]
                    for r in db.execute(
                        "SELECT result FROM lines WHERE batch_id = ? AND state = ? ORDER BY line_no",
                        (batch_id, state),
                    )
                ]
                if results:
                    content = ("\n".join(results) + "\n").encode()
                    f = self._insert_file(
                        db, b["tenant"], "batch_output", f"{batch_id}_{kind}.jsonl", content
                    )
                    ids[kind] = f["id"]
            status, stamp = final_status(b)
            db.execute(
                f"UPDATE batches SET status = ?, {stamp} = COALESCE({stamp}, ?), output_file_id = ?, "
                "error_file_id = ? WHERE id = ?",
                (status, now, ids.get("output"), ids.get("error"), batch_id),
            )
            # The results now live in the files.
            db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
