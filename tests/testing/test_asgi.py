from __future__ import annotations

import httpx

from backends_testkit.asgi import asgi_app


async def test_a_handler_served_as_asgi_sees_method_path_query_and_body() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            201,
            json={
                "method": request.method,
                "path": request.url.path,
                "mode": request.url.params.get("mode"),
                "body": request.content.decode(),
            },
        )

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi_app(handle)), base_url="http://emu") as client:
        response = await client.post("/pause?mode=keep", content=b'{"x":1}')
    assert response.status_code == 201
    assert response.json() == {"method": "POST", "path": "/pause", "mode": "keep", "body": '{"x":1}'}
