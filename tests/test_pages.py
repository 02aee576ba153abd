"""Browser pages served by the replica itself: API docs, with no asset from outside."""

import re

import pytest

from tests.fakes import ScriptedModel
from tests.test_app import running

# Anything that makes a browser reach another host: absolute or protocol-relative URLs.
EXTERNAL = re.compile(r"""(?:src|href|url|spec-url)\s*[=:(]\s*["']?(?:[a-z]+:)?//""", re.I)
ASSET = re.compile(r"""(?:src|href)=["'](/[^"']+)["']""")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_every_asset_from_the_replica(registry, page):
    async with running(ScriptedModel(), registry) as client:
        html = (await client.get(page)).text
        assert EXTERNAL.search(html) is None, EXTERNAL.search(html)
        assets = ASSET.findall(html)
        assert any(a.endswith(".js") for a in assets), html
        for asset in assets:
            response = await client.get(asset)
            assert response.status_code == 200, asset
            assert len(response.content) > 1000, asset
        spec = await client.get("/openapi.json")
    assert spec.status_code == 200
