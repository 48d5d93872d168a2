"""The transports: each turns its protocol into requests through :mod:`cosyserve.server.synth` and sends back what
it answers, and holds nothing but its protocol.

- :mod:`~cosyserve.server.transports.openai_api`: ``POST /v1/audio/speech`` (audio and SSE), the models list;
- :mod:`~cosyserve.server.transports.reference_api`: the reference's ``/inference_*`` endpoints;
- :mod:`~cosyserve.server.transports.ws`: the WebSocket ``/v1/audio/speech/stream`` (text in as it is written);
- :mod:`~cosyserve.server.transports.wyoming`: Home Assistant's Wyoming protocol, beside HTTP;
- :mod:`~cosyserve.server.transports.voices`: OpenAI's voices API over the voice registry.
"""
