"""OpenAI conversations: ``/v1/conversations`` and their items.

A response created with ``conversation`` sees the conversation's items
before its input, and appends its input and output when it ends (see
``lmspd.history``). Items are validated like request input and stored in
the shapes ``input_items`` lists.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from lmspd import idempotency
from lmspd.bodies import read_json_object
from lmspd.core.errors import ApiError, invalid
from lmspd.core.ids import new_id
from lmspd.core.limits import MAX_CONVERSATION_ITEMS_PER_CALL
from lmspd.dialects.openai_responses import input_item_json
from lmspd.dialects.responses_items import StrDict, Strict, decode_items, validation_error
from lmspd.history import StoredContext
from lmspd.http import LmspdApp, app_state, json_reply, json_reply_off_loop, principal
from lmspd.idempotency import Reply
from lmspd.routes.stored import list_json, page_params
from lmspd.store.base import JSON, ConversationRecord, DuplicateItem, InvalidCursor, ensure_item_ids


class CreateConversation(Strict):
    items: list[Any] | None = Field(default=None, max_length=MAX_CONVERSATION_ITEMS_PER_CALL)
    metadata: StrDict | None = None


class UpdateConversation(Strict):
    # Required, and null clears it (the SDK's Required[Optional[Metadata]]).
    metadata: StrDict | None


class AddItems(Strict):
    items: list[Any] = Field(max_length=MAX_CONVERSATION_ITEMS_PER_CALL)


def not_found(conversation_id: str) -> ApiError:
    return ApiError("conversation_not_found", f"Conversation {conversation_id!r} not found.")


def conversation_json(record: ConversationRecord) -> dict[str, Any]:
    return {"id": record.id, "object": "conversation", "created_at": int(record.created_at),
            "metadata": record.metadata}


def _parse(raw: dict[str, Any], model: type[Strict]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _body(request: Request, app: LmspdApp, model: type[Strict]) -> Any:
    return _parse(await read_json_object(request, app.limits), model)


def _metadata(app: LmspdApp, metadata: dict[str, str] | None) -> dict[str, str]:
    limits = app.limits
    metadata = metadata or {}
    if len(metadata) > limits.max_metadata_pairs:
        raise invalid(f"'metadata' has {len(metadata)} keys; the limit is {limits.max_metadata_pairs}.", "metadata")
    for key, value in metadata.items():
        if len(key) > limits.max_metadata_key_chars or len(value) > limits.max_metadata_value_chars:
            raise invalid(f"'metadata.{key[:64]}' is too long.", "metadata")
    return metadata


def _duplicate(exc: DuplicateItem) -> ApiError:
    where = f"items[{exc.index}].id"
    held = "an earlier item of 'items' has too" if exc.repeated else "the conversation already holds"
    return invalid(f"'{where}' is {exc.item_id!r}, which {held}; item ids are unique within a conversation.",
                   where)


def _items(app: LmspdApp, raw: list[Any] | None, owner: str) -> list[JSON]:
    # A compaction item is opened here (a tampered one is refused now, not
    # on the conversation's next turn) and stored as it came.
    items = decode_items(raw or [], app.limits, path="items",
                         open_compaction=StoredContext(app.store, owner, app.sealer).open_compaction)
    return ensure_item_ids([input_item_json(i) for i in items])


async def create_conversation(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    raw = await read_json_object(request, app.limits)

    async def create() -> Reply:
        body = _parse(raw, CreateConversation)
        metadata = _metadata(app, body.metadata)
        items = await app.calls(_items, app, body.items, owner)
        try:
            record = await app.calls(app.store.create_conversation, owner, new_id("conv"), metadata=metadata,
                                     items=items)
        except DuplicateItem as exc:
            raise _duplicate(exc) from None
        return Reply(json_reply(conversation_json(record)))

    return await idempotency.once(app.store, app.calls, owner, request, raw, create)


async def get_conversation(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:read").owner
    conversation_id = request.path_params["conversation_id"]
    record = await app.calls(app.store.get_conversation, owner, conversation_id)
    if record is None:
        raise not_found(conversation_id)
    return json_reply(conversation_json(record))


async def update_conversation(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    conversation_id = request.path_params["conversation_id"]
    body = await _body(request, app, UpdateConversation)
    record = await app.calls(app.store.update_conversation, owner, conversation_id, _metadata(app, body.metadata))
    if record is None:
        raise not_found(conversation_id)
    return json_reply(conversation_json(record))


async def delete_conversation(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    conversation_id = request.path_params["conversation_id"]
    if not await app.calls(app.store.delete_conversation, owner, conversation_id):
        raise not_found(conversation_id)
    return json_reply({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


async def add_items(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    conversation_id = request.path_params["conversation_id"]
    raw = await read_json_object(request, app.limits)

    async def add() -> Reply:
        body = _parse(raw, AddItems)
        # Up to a body's worth of items: decoded, then stored, off the event loop.
        items = await app.calls(_items, app, body.items, owner)
        try:
            stored = await app.calls(app.store.append_conversation_items, owner, conversation_id, items)
        except DuplicateItem as exc:
            raise _duplicate(exc) from None
        if stored is None:
            raise not_found(conversation_id)
        return Reply(await json_reply_off_loop(lambda: {
            "object": "list", "data": stored, "has_more": False,
            "first_id": stored[0]["id"] if stored else None, "last_id": stored[-1]["id"] if stored else None}))

    return await idempotency.once(app.store, app.calls, owner, request, raw, add)


async def list_items(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:read").owner
    conversation_id = request.path_params["conversation_id"]
    after, limit, order = page_params(request)
    try:
        page = await app.calls(app.store.list_conversation_items, owner, conversation_id, after=after,
                               limit=limit, order=order)  # type: ignore[arg-type]
    except InvalidCursor:
        raise invalid(f"'after' names item {after!r}, which is not in this list.", "after") from None
    if page is None:
        raise not_found(conversation_id)
    return await json_reply_off_loop(lambda: list_json(page))


async def get_item(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:read").owner
    conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
    item = await app.calls(app.store.get_conversation_item, owner, conversation_id, item_id)
    if item is None:
        if await app.calls(app.store.get_conversation, owner, conversation_id) is None:
            raise not_found(conversation_id)
        raise ApiError("not_found", f"Item {item_id!r} not found in conversation {conversation_id!r}.")
    return await json_reply_off_loop(lambda: item)


async def delete_item(request: Request) -> Response:
    app = app_state(request)
    owner = principal(request, "responses:write").owner
    conversation_id, item_id = request.path_params["conversation_id"], request.path_params["item_id"]
    if not await app.calls(app.store.delete_conversation_item, owner, conversation_id, item_id):
        if await app.calls(app.store.get_conversation, owner, conversation_id) is None:
            raise not_found(conversation_id)
        raise ApiError("not_found", f"Item {item_id!r} not found in conversation {conversation_id!r}.")
    record = await app.calls(app.store.get_conversation, owner, conversation_id)
    if record is None:
        raise not_found(conversation_id)
    return json_reply(conversation_json(record))
