from specpilot.services.forcer.main import main

main()
