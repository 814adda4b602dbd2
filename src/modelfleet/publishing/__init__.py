"""Publishing model packages through the API: ``modelfleet push``, ``PUT
/v1/models/{m}/package`` and the protocol's load with ``file:`` parameters.

    package.py     a package in transit: archive, files or folder to checked paths,
                   limits, digest and signature
    validate.py    its manifest, its version, and its entrypoint imported in a
                   throwaway interpreter (entrypoint.py is that interpreter's side)
    publisher.py   who may publish what, then the write, the refresh, the announcement
    announce.py    the catalog change told to the fleet
    push.py        the command-line client
"""
