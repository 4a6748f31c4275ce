"""The Dilu client library: deploy functions and call them over NATS.

(Filled in by the client modules: ``spec`` for spec files, ``functions`` for the API a
function's class implements, the async and sync clients, ``admin`` for deploy/undeploy/status.)
"""
