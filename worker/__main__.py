import sys

from jaxdist import service

service.reexec_with_task_environment()  # before anything big is allocated

from jaxdist.worker.server import main  # noqa: E402

sys.exit(main())
