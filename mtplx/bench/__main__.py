import sys

from mtplx.bench.run import main

sys.exit(main())
