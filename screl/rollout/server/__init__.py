"""The OpenAI-compatible policy server (:mod:`.server`, ``generation.expose_http_server``): its request and reply
shapes (chat, completions, responses, streaming), tool-call parsing and the sessions that record each agent's
turns token by token. Above the workflows (it asks them for a turn's seed and its record), never below."""
