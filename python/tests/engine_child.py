"""A framework process for the tests: started under ferry's allocator
(python -m ferry.run engine_child.py), it runs each JSON line of Python
it reads on stdin in one namespace and answers with the JSON of `out`
(or {"error": traceback}) on one line of stdout."""

import json
import sys
import traceback

ns = {"__name__": "engine_child"}
for line in sys.stdin:
    ns["out"] = None
    try:
        exec(json.loads(line), ns)
        answer = {"out": ns["out"]}
    except BaseException:
        answer = {"error": traceback.format_exc()}
    print(json.dumps(answer), flush=True)
