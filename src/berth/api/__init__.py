"""The admin API's contract, shared by the daemon that serves it and the programs that call it
(the CLI, ``berth doctor``): ``client`` talks to a daemon over its Unix socket.
"""
