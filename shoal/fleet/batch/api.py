"""OpenAI's Files and Batch routes on the gateway. Each file and batch belongs to the tenant that
created it: another tenant's ids answer 404, as if they did not exist."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from shoal.fleet.admission.tenants import Tenant
from shoal.fleet.batch.runner import BatchService
from shoal.protocol.bodies import parse_json_object
from shoal.protocol.errors import APIError

FILES_PATH = "/v1/files"
PURPOSES = ("batch",)


def _limit(raw: Request, default: int, most: int) -> int:
    value = raw.query_params.get("limit")
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise APIError(400, f"limit must be an integer from 1 to {most}", "limit")
    return int(value)


def _page(data: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"no such file: {file_id[:100]}", "file_id", "file_not_found")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"no such batch: {batch_id[:100]}", "batch_id", "batch_not_found")


def install_batch_routes(
    app: FastAPI, svc: BatchService, authenticate: Callable[[Request], Tenant], cap: int
) -> None:
    """The routes, each for the tenant `authenticate` finds in the request; files up to `cap` bytes."""

    @app.post(FILES_PATH)
    async def upload_file(raw: Request):
        tenant = authenticate(raw)  # before the upload is read
        form = await raw.form(max_files=1, max_fields=8)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "give the file as the multipart field 'file'", "file")
            if purpose not in PURPOSES:
                raise APIError(400, f"purpose must be one of {', '.join(PURPOSES)}", "purpose")
            content = await upload.read(cap + 1)
            filename = (upload.filename or "upload.jsonl")[:255]
        finally:
            await form.close()
        if len(content) > cap:
            raise APIError(413, f"the file is larger than {cap} bytes", "file", "file_too_large")
        return await svc.db(svc.store.add_file, tenant.name, purpose, filename, content)

    @app.get(FILES_PATH)
    async def list_files(raw: Request):
        tenant = authenticate(raw)
        order = raw.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be asc or desc", "order")
        data, more = await svc.db(
            svc.store.list_files,
            tenant.name,
            raw.query_params.get("purpose"),
            _limit(raw, 10_000, 10_000),
            raw.query_params.get("after"),
            order == "desc",
        )
        return _page(data, more)

    @app.get(FILES_PATH + "/{file_id}")
    async def get_file(file_id: str, raw: Request):
        tenant = authenticate(raw)
        f = await svc.db(svc.store.get_file, tenant.name, file_id)
        if f is None:
            raise _no_file(file_id)
        return f

    @app.get(FILES_PATH + "/{file_id}/content")
    async def file_content(file_id: str, raw: Request):
        tenant = authenticate(raw)
        content = await svc.db(svc.store.file_content, tenant.name, file_id)
        if content is None:
            raise _no_file(file_id)
        return Response(content, media_type="application/octet-stream")

    @app.delete(FILES_PATH + "/{file_id}")
    async def delete_file(file_id: str, raw: Request):
        tenant = authenticate(raw)
        if not await svc.db(svc.store.delete_file, tenant.name, file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(raw: Request):
        tenant = authenticate(raw)
        body = parse_json_object(await raw.body())
        return await svc.create(
            tenant.name,
            body.get("input_file_id"),
            body.get("endpoint"),
            body.get("completion_window"),
            body.get("metadata"),
        )

    @app.get("/v1/batches")
    async def list_batches(raw: Request):
        tenant = authenticate(raw)
        limit = _limit(raw, 20, 100)
        data, more = await svc.db(svc.store.list_batches, tenant.name, limit, raw.query_params.get("after"))
        return _page(data, more)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, raw: Request):
        tenant = authenticate(raw)
        batch = await svc.db(svc.store.get_batch, tenant.name, batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        return batch

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, raw: Request):
        tenant = authenticate(raw)
        batch = await svc.cancel(tenant.name, batch_id)
        if batch is None:
            raise _no_batch(batch_id)
        if batch["status"] not in ("cancelling", "cancelled"):
            raise APIError(
                409, f"cannot cancel a batch that is {batch['status']}", code="batch_not_cancellable"
            )
        return batch
