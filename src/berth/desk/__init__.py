"""The desk worker: this leader's models offered to an ow desk, a marketplace that hands out jobs.

The worker follows the ow desk worker protocol (``shared/specs/ow-desk-protocol.md``, as
``docs/desk.md`` describes it for users): it registers each served model with the desk as a
node, sends pulses (heartbeats), claims jobs, answers each through the leader's own OpenAI
endpoint (so the router may send it to any node of the cluster), and reports finish or fail.
Sealed prompts are opened here, with the host's X25519 key, and live only in memory.

The package sits at the top of berth's layers, beside ``cli``: it talks to the leader only
over the leader's API (its Unix socket), never by importing the daemon.

- ``wire``: the desk's messages, typed, with one validating decoder;
- ``sealing``: the host key pair and the opening of sealed prompts;
- ``state``: ``$BERTH_HOME/desk/nodes.json`` and ``enckey.json``;
- ``client``: the desk's HTTP API;
- ``leader``: what the worker asks of the berth leader;
- ``pulse``: the pure decisions (what a pulse says, when one is due, backoff);
- ``worker``: the pulse and claim loop and the jobs it runs;
- ``commands``: register, status, check and link, as the CLI calls them.
"""
