"""A typed client for llamastream's Generation service, sync and asyncio.

    from llamastream_client import Client, TextDelta

    client = Client("localhost:50051")
    for event in client.chat([("user", "What is the capital of France?")], max_tokens=64):
        if isinstance(event, TextDelta):
            print(event.text, end="", flush=True)
        else:  # the last event: a Completion, with the usage
            print("\\n", event.usage)

Calls that fail before the server answers with UNAVAILABLE (a restart, a drain, a
busy replica) are retried with exponential backoff by gRPC's own retry policy.
"""

from llamastream_client.client import AsyncClient, Client, Completion, Event, TextDelta, Usage

__all__ = ["AsyncClient", "Client", "Completion", "Event", "TextDelta", "Usage"]
