import sys

from bitps.worker.launch.launcher import main

sys.exit(main())
