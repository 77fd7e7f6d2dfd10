from distkv.cli import main

raise SystemExit(main())
