"""The studio's web side: a local page and API to look inside a trained model (python studio.py).

    server       the FastAPI app: the page, its JSON API, the model served one request at a time
    talk         sampling streamed as server-sent events, with each step's alternatives
    completions  POST /v1/completions in OpenAI's format
    requests     what a client may send: fields, limits, and the 4xx errors that name the field
    history      the run's loss curves and samples.md, for the "how it learned" panel
    static/      the page: plain HTML, JavaScript and SVG, shipped with the project (works offline)

The looking itself (alternatives, head scores, the logit lens) is core code in generation/lens.py, and
the copy finder is data/copies.py; the studio only serves them.
"""
