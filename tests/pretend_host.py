"""Run SCRIPT as `python SCRIPT ARGS` would, with socket.gethostname() answering the host name
that UCP_TEST_HOSTS (comma-separated, one per rank) gives this rank: pretended nodes on one
machine, for the local checkpoint tier's tests (its folders are per host name).

    torchrun ... tests/pretend_host.py pretrain_gpt_ucp.py ARGS   # UCP_TEST_HOSTS=node0,node0,node1,node1
"""

import os
import runpy
import socket
import sys

node = os.environ["UCP_TEST_HOSTS"].split(",")[int(os.environ["RANK"])]
socket.gethostname = lambda: node
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
