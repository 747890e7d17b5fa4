"""``dynstate serve``: a local, read-only web view of a store — versions, rows, lineage and
growth — with a JSON twin of every page. Needs the ``serve`` extra
(``pip install 'dynstate[serve]'``: Starlette, uvicorn, Jinja2); :mod:`dynstate.cli.commands_serve`
(the command) imports none of them until it runs. See docs/serve.md."""
